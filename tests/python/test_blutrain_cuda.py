"""The blutrain Python module on a CUDA device against PyTorch (run on the GPU machine by
scripts/gpu_run.sh python, with a module built for that machine's Python by scripts/python_module.sh;
skipped where torch sees no GPU). Each test can fail: zero-copy is checked by writing through one side
and reading through the other; the DLPack stream handshake by a torch write queued behind a long
kernel, which blutrain must see; the model by PyTorch's own cross-entropy; training by the loss
falling."""
import sys
import unittest

import torch

sys.path.insert(0, sys.argv.pop(1))
import blutrain as bt  # noqa: E402


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class CudaZeroCopy(unittest.TestCase):
    def test_torch_to_blutrain_and_back(self):
        x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
        t = bt.from_dlpack(x)
        self.assertEqual(t.device, "cuda:0")
        self.assertEqual(t.shape, (3, 4))
        x[1, 2] = 100.0  # written through torch (its stream), read through blutrain once it is done
        torch.cuda.synchronize()
        self.assertEqual(t.tolist()[6], 100.0)
        y = torch.from_dlpack(t)  # and back: the same device memory
        self.assertEqual(y.device.type, "cuda")
        self.assertEqual(y.data_ptr(), x.data_ptr())
        y[0, 0] = -5.0
        torch.cuda.synchronize()
        self.assertEqual(x[0, 0].item(), -5.0)
        self.assertEqual(t.tolist()[0], -5.0)

    def test_import_waits_for_torch_work_still_queued(self):
        # A fill queued behind a ~0.5 s spin on torch's stream: blutrain reads on its own stream,
        # so it sees the fill only if from_dlpack made that stream wait (DLPack's stream argument).
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1000 * 0.5))
        x.fill_(3.0)
        t = bt.from_dlpack(x)
        s = bt.from_dlpack(torch.ones(1, device="cuda"))  # any op on blutrain's stream
        self.assertEqual(min(t.tolist()), 3.0)
        self.assertEqual(s.tolist(), [1.0])

    def test_blutrain_results_reach_torch(self):
        m = bt.build_model("gpt2:tiny", seed=2, device="cuda")
        idx = torch.randint(0, m.vocab_size, (2, 8), device="cuda")
        logits, _ = m.forward(bt.from_dlpack(idx))
        lt = torch.from_dlpack(logits)  # made on blutrain's stream; exported once it is done
        self.assertEqual(lt.device.type, "cuda")
        self.assertEqual(tuple(lt.shape[:2]), (2, 8))
        self.assertGreaterEqual(lt.shape[2], m.vocab_size)  # GPT-2's vocabulary padded to a multiple of 64
        self.assertTrue(torch.isfinite(lt).all().item())
        self.assertGreater(lt.abs().max().item(), 0.0)

    def test_producer_outlives_python_handle(self):
        x = torch.full((1000,), 7.0, device="cuda")
        t = bt.from_dlpack(x)
        del x
        self.assertEqual(t.tolist()[999], 7.0)
        y = torch.from_dlpack(t)
        del t
        self.assertEqual(y[999].item(), 7.0)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class CudaModels(unittest.TestCase):
    def test_forward_matches_torch_cross_entropy_and_params_are_shared(self):
        m = bt.build_model("llama:tiny", seed=3, device="cuda")
        idx = torch.randint(0, m.vocab_size, (2, 9), device="cuda")
        tgt = torch.randint(0, m.vocab_size, (2, 9), device="cuda")
        logits, loss = m.forward(bt.from_dlpack(idx), bt.from_dlpack(tgt))
        lt = torch.from_dlpack(logits)
        ref = torch.nn.functional.cross_entropy(lt.reshape(-1, lt.shape[-1]).double(), tgt.reshape(-1))
        self.assertAlmostEqual(loss.item(), ref.item(), places=4)
        p = m.parameters()
        self.assertEqual(p["model.norm.weight"].device, "cuda:0")
        w = torch.from_dlpack(p["model.norm.weight"])
        w.mul_(0.0)  # written from torch into the model's own parameter, on the device
        torch.cuda.synchronize()
        p["model.norm.weight"].mark_written()
        logits2, _ = m.forward(bt.from_dlpack(idx))
        self.assertEqual(float(torch.from_dlpack(logits2).abs().max()), 0.0)

    def test_train_steps_on_the_device(self):
        m = bt.build_model("gpt2:tiny", seed=1, device="cuda")
        opt = bt.Optimizer(m, lr=3e-3)
        idx = bt.from_dlpack(torch.randint(0, 50, (4, 16), device="cuda"))
        losses = [opt.step(lambda i: m.loss(idx, idx))["loss"] for _ in range(8)]
        self.assertLess(losses[-1], losses[0] - 0.5, losses)
        self.assertEqual(m.parameters()["h.0.attn.c_attn.weight"].device, "cuda:0")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
