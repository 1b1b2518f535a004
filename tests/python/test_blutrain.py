"""The blutrain Python module against Debian's PyTorch and NumPy (run by tests/CMakeLists.txt with
/usr/bin/python3 and the build's python/ folder on sys.path). Each test can fail: zero-copy is
checked by writing through one side and reading through the other, the model by PyTorch's own
cross-entropy, training by the loss falling."""
import json
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, sys.argv.pop(1))
import blutrain as bt  # noqa: E402


class ZeroCopy(unittest.TestCase):
    def test_torch_to_blutrain_and_back(self):
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        t = bt.from_dlpack(x)
        self.assertEqual(t.shape, (3, 4))
        self.assertEqual(t.dtype, "f32")
        x[1, 2] = 100.0  # written through torch, read through blutrain
        self.assertEqual(t.tolist()[6], 100.0)
        y = torch.from_dlpack(t)  # and back: the same memory
        self.assertEqual(y.data_ptr(), x.data_ptr())
        y[0, 0] = -5.0
        self.assertEqual(x[0, 0].item(), -5.0)

    def test_numpy_both_ways(self):
        a = np.linspace(0, 1, 10, dtype=np.float64)
        t = bt.from_dlpack(a)
        a[3] = 42.0
        self.assertEqual(t.tolist()[3], 42.0)
        b = t.numpy()  # NumPy marks arrays it imports through DLPack read-only; the memory is shared
        torch.from_dlpack(t)[4] = -1.0
        self.assertEqual(b[4], -1.0)
        self.assertEqual(a[4], -1.0)

    def test_views_and_dtypes(self):
        x = torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, 1::2]  # a strided view
        t = bt.from_dlpack(x)
        self.assertEqual(t.tolist(), x.flatten().tolist())
        for dt, name in [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.int64, "i64"), (torch.int32, "i32")]:
            self.assertEqual(bt.from_dlpack(torch.zeros(3, dtype=dt)).dtype, name)
        with self.assertRaises(bt.Error):
            bt.from_dlpack(torch.zeros(3, dtype=torch.complex64))

    def test_producer_outlives_python_handle(self):
        x = torch.full((1000,), 7.0)
        t = bt.from_dlpack(x)
        del x  # blutrain keeps torch's buffer alive
        self.assertEqual(t.tolist()[999], 7.0)
        y = torch.from_dlpack(t)
        del t  # torch keeps blutrain's buffer alive
        self.assertEqual(y[999].item(), 7.0)


class Models(unittest.TestCase):
    def test_forward_matches_torch_cross_entropy_and_params_are_shared(self):
        m = bt.build_model("llama:tiny", seed=3)
        self.assertEqual(m.family, "llama")
        self.assertEqual(m.config["family"], "llama")
        idx = torch.randint(0, m.vocab_size, (2, 9))
        tgt = torch.randint(0, m.vocab_size, (2, 9))
        logits, loss = m.forward(bt.from_dlpack(idx), bt.from_dlpack(tgt))
        lt = torch.from_dlpack(logits)
        ref = torch.nn.functional.cross_entropy(lt.reshape(-1, lt.shape[-1]).double(), tgt.reshape(-1))
        self.assertAlmostEqual(loss.item(), ref.item(), places=5)
        p = m.parameters()
        w = torch.from_dlpack(p["model.norm.weight"])
        w.mul_(0.0)  # written from torch into the model's own parameter
        p["model.norm.weight"].mark_written()
        logits2, _ = m.forward(bt.from_dlpack(idx))
        self.assertEqual(float(torch.from_dlpack(logits2).abs().max()), 0.0)

    def test_train_steps_safetensors_and_sampling(self):
        m = bt.build_model("gpt2:tiny", seed=1)
        opt = bt.Optimizer(m, lr=3e-3)
        idx = bt.from_dlpack(torch.randint(0, 50, (4, 16)))
        losses = [opt.step(lambda i: m.loss(idx, idx))["loss"] for _ in range(8)]
        self.assertLess(losses[-1], losses[0] - 0.5, losses)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "w.safetensors")
            bt.save_safetensors(path, m.state_dict())
            back = bt.load_safetensors(path)
            self.assertEqual(set(back), set(m.state_dict()))
            k = "h.0.attn.c_attn.weight"
            self.assertTrue(torch.equal(torch.from_dlpack(back[k]), torch.from_dlpack(m.state_dict()[k])))
        # AdamW's moments in bf16: the same first loss, then within a few percent; a bad dtype by name.
        m16, m32 = bt.build_model("gpt2:tiny", seed=1), bt.build_model("gpt2:tiny", seed=1)
        o16, o32 = bt.Optimizer(m16, lr=3e-3, state_dtype="bf16"), bt.Optimizer(m32, lr=3e-3)
        l16 = [o16.step(lambda i: m16.loss(idx, idx))["loss"] for _ in range(4)]
        l32 = [o32.step(lambda i: m32.loss(idx, idx))["loss"] for _ in range(4)]
        self.assertEqual(l16[0], l32[0])
        for a, b in zip(l16, l32):
            self.assertAlmostEqual(a, b, delta=2e-2 * b)
        with self.assertRaisesRegex(Exception, "state_dtype must be 'f32' or 'bf16', got 'f16'"):
            bt.Optimizer(m16, state_dtype="f16")
        out = m.generate([1, 2, 3], 5, temperature=0.0)  # the new tokens
        self.assertEqual(len(out), 5)
        self.assertEqual(out, m.generate([1, 2, 3], 5, temperature=0.0))


class Trainer(unittest.TestCase):
    def test_train_with_progress(self):
        with tempfile.TemporaryDirectory() as d:
            # Two token shards in llm.c's layout: a repeating count the model learns.
            tokens = np.arange(4096, dtype=np.uint16) % 64
            header = np.zeros(256, dtype=np.int32)
            header[0], header[1], header[2] = 20240520, 1, len(tokens)
            for name in ("train_000.bin", "val_000.bin"):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(header.tobytes())
                    f.write(tokens.tobytes())
            seen = []
            summary = bt.train({"model": "gpt2:tiny", "train_pattern": os.path.join(d, "train_*.bin"),
                                "val_pattern": os.path.join(d, "val_*.bin"), "batch_size": 4, "seq_len": 32,
                                "steps": 12, "lr": 3e-3, "warmup": 2, "out": os.path.join(d, "run")},
                               progress=lambda s: seen.append(s))
            self.assertEqual(summary["end_step"], 12)
            self.assertEqual([s["step"] for s in seen], list(range(1, 13)))
            self.assertLess(seen[-1]["loss"], seen[0]["loss"])
            m = bt.load_model(os.path.join(d, "run"))
            self.assertEqual(m.config, json.loads(json.dumps(m.config)))
            # The head's loss in row pieces: the same run's losses within fp32 rounding, recorded.
            pieces = []
            bt.train({"model": "gpt2:tiny", "train_pattern": os.path.join(d, "train_*.bin"),
                      "val_pattern": os.path.join(d, "val_*.bin"), "batch_size": 4, "seq_len": 32,
                      "steps": 12, "lr": 3e-3, "warmup": 2, "out": os.path.join(d, "pieces"), "loss_chunks": 4},
                     progress=lambda s: pieces.append(s))
            for a, b in zip(seen, pieces):
                self.assertAlmostEqual(a["loss"], b["loss"], delta=1e-4 * a["loss"])
            with open(os.path.join(d, "pieces", "run.json")) as f:
                self.assertEqual(json.load(f)["options"]["loss_chunks"], 4)
            # Split master weights (bf16): recorded, and refused in fp32 by name.
            bt.train({"model": "gpt2:tiny", "train_pattern": os.path.join(d, "train_*.bin"), "batch_size": 4,
                      "seq_len": 32, "steps": 4, "lr": 3e-3, "warmup": 2, "precision": "bf16",
                      "master_weights": "split", "out": os.path.join(d, "split")})
            with open(os.path.join(d, "split", "run.json")) as f:
                self.assertEqual(json.load(f)["options"]["master_weights"], "split")
            with self.assertRaises(bt.Error) as e:
                bt.train({"model": "gpt2:tiny", "train_pattern": os.path.join(d, "train_*.bin"), "steps": 1,
                          "master_weights": "split"})
            self.assertIn("--master-weights split keeps each fp32 master", str(e.exception))
            with self.assertRaises(bt.Error) as e:
                bt.train({"stepz": 3})
            self.assertIn("unknown option 'stepz'", str(e.exception))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
