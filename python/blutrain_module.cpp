// python/blutrain_module: the `blutrain` Python module (pybind11). What a Python user reaches:
//   Tensor — BluTrain tensors, exchanged with PyTorch and NumPy without copies through DLPack
//     (`torch.from_dlpack(t)`, `numpy.from_dlpack(t)`, `blutrain.from_dlpack(x)`); backward, grad;
//   build_model / load_model — a model from the registry (`"llama:tiny"`, `"gpt2:d12"`, a Hugging
//     Face folder) or a checkpoint; forward, parameters (shared, not copied), generate, save;
//   load_safetensors / save_safetensors;
//   Optimizer — the single-device training step (dist::Strategy: forward/backward over
//     micro-batches, clipping, AdamW or SGD) driven by a Python loss function;
//   train — the trainer with its options as keyword arguments and a progress callback.
// Memory shared through DLPack: a tensor made by from_dlpack keeps the producer's buffer alive
// (its deleter runs when the last BluTrain view goes, under the GIL); a capsule from __dlpack__
// keeps the BluTrain storage alive until the consumer releases it. Writes made through the other
// framework do not bump BluTrain's storage versions: call Tensor.mark_written() after writing into
// a parameter from outside (Note [Storage versions], core/storage.h).
// Depends on everything below apps/ (it is an application of the library, like apps/blutrain).
#include <dlpack/dlpack.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "blu/blu.h"
#include "blu/dist/strategy.h"
#include "blu/io/safetensors.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"

#ifdef BLU_HAVE_CUDA
#include <cuda_runtime.h>

#include "blu/core/cuda/runtime.h"
#endif

namespace py = pybind11;
using namespace blu;

namespace {

// --- DLPack ---------------------------------------------------------------------------------

DLDataType to_dl(DType t) {
  switch (t) {
    case DType::f32: return {kDLFloat, 32, 1};
    case DType::f64: return {kDLFloat, 64, 1};
    case DType::f16: return {kDLFloat, 16, 1};
    case DType::bf16: return {kDLBfloat, 16, 1};
    case DType::i32: return {kDLInt, 32, 1};
    case DType::i64: return {kDLInt, 64, 1};
    default: break;
  }
  BLU_CHECK(false, "__dlpack__: no DLPack type for dtype ", t);
  return {};
}

DType from_dl(DLDataType d) {
  BLU_CHECK(d.lanes == 1, "from_dlpack: vector types (lanes ", int(d.lanes), ") are not supported");
  if (d.code == kDLFloat && d.bits == 32) return DType::f32;
  if (d.code == kDLFloat && d.bits == 64) return DType::f64;
  if (d.code == kDLFloat && d.bits == 16) return DType::f16;
  if (d.code == kDLBfloat && d.bits == 16) return DType::bf16;
  if (d.code == kDLInt && d.bits == 32) return DType::i32;
  if (d.code == kDLInt && d.bits == 64) return DType::i64;
  BLU_CHECK(false, "from_dlpack: unsupported DLPack type (code ", int(d.code), ", ", int(d.bits),
            " bits); expected float32/64/16, bfloat16, int32 or int64");
  return DType::f32;
}

struct Exported {  // what a DLManagedTensor from __dlpack__ owns
  Tensor tensor;
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed{};
};

void wait_for_device(const Tensor& t) {
#ifdef BLU_HAVE_CUDA
  if (t.device().is_cuda()) cudaDeviceSynchronize();  // the consumer's stream is not ours to wait on
#else
  (void)t;
#endif
}

py::capsule to_dlpack(const Tensor& t) {
  auto* e = new Exported{t.detach(), t.shape(), t.strides()};
  DLTensor& d = e->managed.dl_tensor;
  d.data = t.numel() ? static_cast<void*>(static_cast<std::byte*>(t.storage()->ptr())) : nullptr;
  d.byte_offset = uint64_t(t.offset()) * t.itemsize();
  d.device = {t.device().is_cuda() ? kDLCUDA : kDLCPU, int32_t(t.device().index)};
  d.ndim = int32_t(t.dim());
  d.dtype = to_dl(t.dtype());
  d.shape = e->shape.data();
  d.strides = e->strides.data();
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); };
  wait_for_device(t);
  // A capsule nobody consumed (still named "dltensor") frees its tensor with the capsule.
  return py::capsule(&e->managed, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (m && m->deleter) m->deleter(m);
    }
  });
}

Tensor from_dlpack(const py::object& obj) {
  BLU_CHECK(py::hasattr(obj, "__dlpack__"), "from_dlpack: expected an object with __dlpack__ (a torch tensor, a "
            "NumPy array), got ", std::string(py::str(obj.get_type())));
  py::object cap;
#ifdef BLU_HAVE_CUDA
  if (py::hasattr(obj, "__dlpack_device__") && obj.attr("__dlpack_device__")()[py::int_(0)].cast<int>() == kDLCUDA) {
    // DLPack's handshake: the consumer names the stream it will use, and the producer makes that
    // stream wait for the work it still has queued on the tensor.
    cudaStream_t s = cuda::current_stream();
    cap = obj.attr("__dlpack__")(py::arg("stream") = reinterpret_cast<intptr_t>(s));
  } else {
    cap = obj.attr("__dlpack__")();
  }
#else
  cap = obj.attr("__dlpack__")();
#endif
  PyObject* c = cap.ptr();
  BLU_CHECK(PyCapsule_IsValid(c, "dltensor"), "from_dlpack: __dlpack__ did not return an unused 'dltensor' capsule");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
  PyCapsule_SetName(c, "used_dltensor");  // DLPack's protocol: a consumed capsule is renamed; the storage owns it
  const DLTensor& d = m->dl_tensor;
  const DType dt = from_dl(d.dtype);
  Device dev = kCPU;
  if (d.device.device_type == kDLCUDA) dev = Device(DeviceType::cuda, d.device.device_id);
  else BLU_CHECK(d.device.device_type == kDLCPU, "from_dlpack: unsupported device type ", int(d.device.device_type));
  Shape shape(d.shape, d.shape + d.ndim), strides;
  if (d.strides) strides.assign(d.strides, d.strides + d.ndim);
  else strides = contiguous_strides(shape);
  int64_t extent = 0;  // elements from the first to one past the last
  if (numel(shape) > 0) {
    extent = 1;
    for (int i = 0; i < d.ndim; ++i) extent += (shape[size_t(i)] - 1) * strides[size_t(i)];
  }
  const size_t item = dtype_size(dt);
  void* base = static_cast<std::byte*>(d.data) + d.byte_offset;
  auto release = [](void* ctx, void*, size_t) {
    auto* mt = static_cast<DLManagedTensor*>(ctx);
    if (!mt->deleter) return;
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;  // NumPy's deleter drops a Python reference
      mt->deleter(mt);
    } else {
      mt->deleter(mt);
    }
  };
  auto storage = std::make_shared<Storage>(DataPtr(base, size_t(extent) * item, dev, release, m));
  return Tensor(storage, shape, strides, 0, dt);
}

py::object tensor_or_none(const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

py::object json_to_py(const nlohmann::json& j) { return py::module_::import("json").attr("loads")(j.dump()); }
nlohmann::json py_to_json(const py::handle& o) {
  return nlohmann::json::parse(std::string(py::str(py::module_::import("json").attr("dumps")(o))));
}

py::dict named(const std::vector<std::pair<std::string, Tensor>>& v) {
  py::dict d;
  for (const auto& [k, t] : v) d[py::str(k)] = t;
  return d;
}

// The model as Python holds it: the registry's CausalLM.
using Model = std::shared_ptr<models::CausalLM>;

class Optimizer {
 public:
  Optimizer(Model model, const std::string& name, double lr, double weight_decay, std::pair<double, double> betas,
            double eps, double momentum, double max_norm, const std::string& state_dtype)
      : model_(std::move(model)), lr_(lr), max_norm_(max_norm) {
    BLU_CHECK(state_dtype == "f32" || state_dtype == "bf16", "Optimizer: state_dtype must be 'f32' or 'bf16', got '",
              state_dtype, "'");
    dist::OptimizerConfig oc;
    oc.name = name, oc.lr = lr, oc.weight_decay = weight_decay, oc.beta1 = betas.first, oc.beta2 = betas.second;
    oc.eps = eps, oc.momentum = momentum, oc.state_dtype = state_dtype == "bf16" ? DType::bf16 : DType::f32;
    strategy_ = std::make_unique<dist::Strategy>(*model_, nullptr, dist::StrategyConfig{}, oc);
  }
  // One optimizer step: loss_of(i) → the loss of micro-batch i (a Tensor).
  py::dict step(const std::function<Tensor(int64_t)>& loss_of, int64_t micro_batches, std::optional<double> lr) {
    const dist::StepValues v = strategy_->step(micro_batches, loss_of, lr.value_or(lr_), max_norm_);
    const dist::StepReadout r = strategy_->read(v, false);
    py::dict d;
    d["loss"] = r.loss;
    d["grad_norm"] = r.grad_norm;
    return d;
  }

 private:
  Model model_;
  double lr_, max_norm_;
  std::unique_ptr<dist::Strategy> strategy_;
};

}  // namespace

PYBIND11_MODULE(blutrain, m) {
  m.doc() = "BluTrain: tensors shared with PyTorch and NumPy through DLPack, models, training.";
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);

  py::class_<Tensor>(m, "Tensor")
      .def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape())); })
      .def_property_readonly("dtype", [](const Tensor& t) { return dtype_name(t.dtype()); })
      .def_property_readonly("device", [](const Tensor& t) { return t.device().str(); })
      .def_property_readonly("requires_grad", &Tensor::requires_grad)
      .def_property_readonly("grad", [](const Tensor& t) { return tensor_or_none(t.grad()); })
      .def("numel", &Tensor::numel)
      .def("item", [](const Tensor& t) { return t.device().is_cpu() ? t.item() : to_device(t, kCPU).item(); },
           "The one element as a float (copied from the device first).")
      .def("tolist", [](const Tensor& t) { return to_vector(t); }, "The elements, row-major, as floats.")
      .def("backward", [](const Tensor& t) { t.backward(); })
      .def("detach", &Tensor::detach)
      .def("to", [](const Tensor& t, const std::string& device) { return to_device(t, Device(device)); })
      .def("mark_written", [](const Tensor& t) { t.storage()->bump_version(); },
           "Tell BluTrain that another framework wrote into this tensor's memory.")
      .def("__dlpack__", [](const Tensor& t, py::object /*stream*/) { return to_dlpack(t); },
           py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const Tensor& t) {
        return py::make_tuple(int(t.device().is_cuda() ? kDLCUDA : kDLCPU), t.device().index);
      })
      .def("numpy", [](const Tensor& t) { return py::module_::import("numpy").attr("from_dlpack")(py::cast(t)); },
           "A NumPy array sharing this tensor's memory (CPU tensors).")
      .def("__repr__", &Tensor::str);

  m.def("from_dlpack", &from_dlpack, py::arg("x"),
        "A BluTrain tensor sharing the memory of a torch tensor, NumPy array or any __dlpack__ producer.");

  py::class_<models::CausalLM, Model>(m, "Model")
      .def_property_readonly("family", &models::CausalLM::family)
      .def_property_readonly("config", [](const models::CausalLM& mo) { return json_to_py(mo.config()); })
      .def_property_readonly("vocab_size", &models::CausalLM::vocab_size)
      .def_property_readonly("max_seq_len", &models::CausalLM::max_seq_len)
      .def("num_parameters", &models::CausalLM::num_parameters)
      .def("forward", [](models::CausalLM& mo, const Tensor& idx, std::optional<Tensor> targets) {
        const models::LMOutput out = mo.forward(idx, targets.value_or(Tensor()));
        return py::make_tuple(out.logits, tensor_or_none(out.loss));
      }, py::arg("idx"), py::arg("targets") = py::none(), "(logits, loss); loss is None without targets.")
      .def("loss", [](models::CausalLM& mo, const Tensor& idx, const Tensor& targets) {
        return mo.forward(idx, targets).loss;
      }, "The mean cross-entropy only (the logits are dropped before backward, saving their memory).")
      .def("parameters", [](const models::CausalLM& mo) { return named(mo.named_parameters()); },
           "Parameters by name; the tensors are the model's own (shared, not copied).")
      .def("state_dict", [](const models::CausalLM& mo) { return named(mo.state_dict()); })
      .def("load_state_dict", [](models::CausalLM& mo, const py::dict& d) {
        nn::NamedTensors s;
        for (auto [k, v] : d) s.emplace_back(py::cast<std::string>(k), py::cast<Tensor>(v));
        mo.load_state_dict(s);
      })
      .def("to", [](models::CausalLM& mo, const std::string& device) { mo.to(Device(device)); })
      .def("train", [](models::CausalLM& mo, bool on) { mo.train(on); }, py::arg("on") = true)
      .def("eval", [](models::CausalLM& mo) { mo.eval(); })
      .def("zero_grad", [](models::CausalLM& mo) { mo.zero_grad(); })
      .def("generate", [](models::CausalLM& mo, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                          double temperature, int64_t top_k, uint64_t seed) {
        Generator gen(seed);
        return mo.generate(prompt, max_new_tokens, temperature, top_k, gen);
      }, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("temperature") = 1.0, py::arg("top_k") = 0,
         py::arg("seed") = 1337)
      .def("export_hf", [](const models::CausalLM& mo, const std::string& dir) {
        models::family(mo.family()).export_hf(mo, dir);
      }, "Writes a Hugging Face folder (config.json + safetensors).");

  m.def("build_model", [](const std::string& spec, uint64_t seed, const std::string& device) {
    Model mo(models::build_model(models::resolve_model_config(spec), seed).release());
    if (device != "cpu") mo->to(Device(device));
    return mo;
  }, py::arg("spec"), py::arg("seed") = 1337, py::arg("device") = "cpu",
     "A model from a registry name (\"gpt2:d12\", \"llama:tiny\") or a Hugging Face folder's config.");
  m.def("load_model", [](const std::string& path, const std::string& device) {
    return Model(train::load_model(path, Device(device)).release());
  }, py::arg("path"), py::arg("device") = "cpu", "A checkpoint, a run directory or a Hugging Face folder.");

  m.def("load_safetensors", [](const std::string& path) {
    const SafeTensorsFile f = SafeTensorsFile::open(path);
    py::dict d;
    for (const TensorEntry& e : f.entries()) {
      Tensor t = empty(e.shape, e.dtype);
      const auto bytes = f.bytes(e);
      if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
      d[py::str(e.name)] = t;
    }
    return d;
  }, py::arg("path"));
  m.def("save_safetensors", [](const std::string& path, const py::dict& tensors) {
    SafeTensorsWriter w;
    std::vector<Tensor> keep;
    for (auto [k, v] : tensors) {
      Tensor c = contiguous(to_device(py::cast<Tensor>(v).detach(), kCPU));
      keep.push_back(c);
      w.add(py::cast<std::string>(k), c.dtype(), c.shape(), {static_cast<const std::byte*>(c.raw_data()), c.nbytes()});
    }
    w.write(path);
  }, py::arg("path"), py::arg("tensors"), "Atomic: the old file stays whole if the write fails.");

  py::class_<Optimizer>(m, "Optimizer")
      .def(py::init<Model, const std::string&, double, double, std::pair<double, double>, double, double, double,
                    const std::string&>(),
           py::arg("model"), py::arg("name") = "adamw", py::arg("lr") = 1e-3, py::arg("weight_decay") = 0.1,
           py::arg("betas") = std::pair<double, double>(0.9, 0.95), py::arg("eps") = 1e-8, py::arg("momentum") = 0.9,
           py::arg("max_norm") = 1.0, py::arg("state_dtype") = "f32")
      .def("step", &Optimizer::step, py::arg("loss_of"), py::arg("micro_batches") = 1, py::arg("lr") = py::none(),
           "One step: loss_of(i) returns micro-batch i's loss; backward, clipping and the update follow. "
           "Returns {'loss', 'grad_norm'}.");

  m.def("train", [](const py::dict& options, py::object progress) {
    // The options as run.json spells them (TrainOptions::to_json), over the defaults.
    train::TrainOptions o;
    nlohmann::json j = o.to_json();
    for (auto [k, v] : options) {
      const std::string key = py::cast<std::string>(k);
      if (key == "allow_changes") {  // not a run.json key: it names this call, not the run
        o.allow_changes = py::cast<bool>(v);
        continue;
      }
      if (key == "loss_chunks") {  // a run.json key only when set (the default run records none)
        o.loss_chunks = py::cast<int64_t>(v);
        continue;
      }
      if (key == "master_weights") {  // likewise: recorded only when "split"
        o.master_weights = py::cast<std::string>(v);
        continue;
      }
      BLU_CHECK(j.contains(key), "train: unknown option '", key, "' (the options are run.json's keys, and allow_changes)");
      j[key] = key == "model" && py::isinstance<py::str>(v) ? models::resolve_model_config(py::cast<std::string>(v))
                                                             : py_to_json(v);
    }
    auto get = [&](const char* k, auto& field) { field = j.at(k).get<std::decay_t<decltype(field)>>(); };
    get("train_pattern", o.train_pattern), get("val_pattern", o.val_pattern), get("init_from", o.init_from);
    o.model = j.at("model");
    if (o.model.is_null() && !o.init_from.empty()) o.model = train::init_source_config(o.init_from);
    get("batch_size", o.batch_size), get("seq_len", o.seq_len), get("grad_accum", o.grad_accum), get("steps", o.steps);
    get("lr", o.lr), get("min_lr", o.min_lr), get("warmup", o.warmup), get("schedule", o.schedule);
    get("weight_decay", o.weight_decay), get("grad_clip", o.grad_clip), get("optimizer", o.optimizer);
    get("beta1", o.beta1), get("beta2", o.beta2), get("adamw_state", o.adamw_state);
    get("seed", o.seed), get("device", o.device), get("precision", o.precision), get("out", o.out);
    get("val_every", o.val_every), get("val_batches", o.val_batches), get("sample_every", o.sample_every);
    get("sample_tokens", o.sample_tokens), get("sample_temperature", o.sample_temperature);
    get("sample_top_k", o.sample_top_k), get("ckpt_every", o.ckpt_every), get("keep_last", o.keep_last);
    get("log_every", o.log_every), get("auto_resume", o.auto_resume);
    train::TrainCallbacks cb;
    if (!progress.is_none()) {
      cb.on_step = [progress](const train::StepStats& s) {
        py::gil_scoped_acquire gil;
        py::dict d;
        d["step"] = s.step, d["total_steps"] = s.total_steps, d["loss"] = s.loss, d["lr"] = s.lr;
        d["grad_norm"] = s.grad_norm, d["ms"] = s.ms, d["tokens_per_s"] = s.tokens_per_s;
        d["elapsed_s"] = s.elapsed_s, d["eta_s"] = s.eta_s;
        progress(d);
      };
    }
    train::TrainSummary sum;
    {
      train::Trainer t(o, cb);
      py::gil_scoped_release nogil;
      sum = t.run();
    }
    py::dict d;
    d["start_step"] = sum.start_step, d["end_step"] = sum.end_step, d["final_train_loss"] = sum.final_train_loss;
    d["final_val_loss"] = sum.final_val_loss, d["tokens"] = sum.tokens, d["seconds"] = sum.seconds;
    d["tokens_per_s"] = sum.tokens_per_s, d["checkpoint"] = sum.checkpoint;
    return d;
  }, py::arg("options"), py::arg("progress") = py::none(),
     "Runs the trainer; options use run.json's keys (model may be a registry name). progress(dict) is called "
     "at each logged step.");
}
