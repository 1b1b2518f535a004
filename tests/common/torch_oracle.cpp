#include "common/torch_oracle.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace blu::test {

namespace fs = std::filesystem;

Tensor tensor_from_entry(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

TorchResults::TorchResults(const std::string& path) : file_(SafeTensorsFile::open(path)) {}

Tensor TorchResults::get(const std::string& name) const {
  const TensorEntry* e = file_.find(name);
  if (!e) {
    ADD_FAILURE() << "PyTorch produced no tensor '" << name << "'";
    return zeros({1});
  }
  return tensor_from_entry(file_, *e);
}

TorchOracle::TorchOracle() {
  char tmpl[] = "/tmp/blu_oracle_XXXXXX";
  const char* d = mkdtemp(tmpl);
  if (!d) throw Error("cannot create a temporary directory for the PyTorch oracle");
  dir_ = d;
}

TorchOracle::~TorchOracle() {
  std::error_code ec;
  if (!std::getenv("BLU_KEEP_ORACLE_FILES")) fs::remove_all(dir_, ec);
}

void TorchOracle::put(const std::string& name, const Tensor& t) { tensors_.emplace_back(name, contiguous(t.detach())); }

TorchResults TorchOracle::run(const std::string& script, const nlohmann::json& manifest) {
  const std::string in = dir_ + "/inputs.safetensors", man = dir_ + "/manifest.json", out = dir_ + "/out.safetensors";
  SafeTensorsWriter w;
  for (auto& [name, t] : tensors_)
    w.add(name, t.dtype(), t.shape(), {static_cast<const std::byte*>(t.raw_data()), t.nbytes()});
  w.write(in);
  std::ofstream(man) << manifest.dump();
  const char* py = std::getenv("BLU_TORCH_PYTHON");
  const std::string python = py ? py : "/usr/bin/python3";
  const std::string probe = python + " -c 'import torch' 2>/dev/null";
  if (std::system(probe.c_str()) != 0) {
    throw Error("the PyTorch oracle needs " + python + " with torch (Debian: apt-get install python3-torch; "
                "scripts/setup.sh installs it)");
  }
  // BLU_TEST_DIR (environment) points at the tests when the binary runs away from its source
  // tree (the GPU machine); otherwise the compiled-in path.
  const char* test_dir = std::getenv("BLU_TEST_DIR");
  const std::string cmd = python + " " + std::string(test_dir ? test_dir : BLU_TEST_DIR) + "/" + script + " " + in + " " + man + " " + out +
                          " > " + dir_ + "/log.txt 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream log(dir_ + "/log.txt");
    std::string text((std::istreambuf_iterator<char>(log)), {});
    throw Error("PyTorch oracle script " + script + " failed:\n" + text);
  }
  return TorchResults(out);
}

}  // namespace blu::test
