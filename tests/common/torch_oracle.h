// tests/common/torch_oracle: hands tensors to a PyTorch script (Debian's python3-torch, run by
// /usr/bin/python3 or $BLU_TORCH_PYTHON) through safetensors files and reads its results back.
// If PyTorch is missing the test fails with the install hint; BLU_ALLOW_SKIP=1 makes it skip.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "blu/blu.h"
#include "blu/io/safetensors.h"

namespace blu::test {

class TorchResults {
 public:
  explicit TorchResults(const std::string& path);
  Tensor get(const std::string& name) const;  // a CPU copy; fails the test when missing
  bool has(const std::string& name) const { return file_.find(name) != nullptr; }

 private:
  SafeTensorsFile file_;
};

class TorchOracle {
 public:
  TorchOracle();
  ~TorchOracle();
  void put(const std::string& name, const Tensor& t);
  // Runs `script` (relative to tests/) as: script inputs.safetensors manifest.json out.safetensors
  TorchResults run(const std::string& script, const nlohmann::json& manifest);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

// Reads a safetensors entry into a new CPU tensor.
Tensor tensor_from_entry(const SafeTensorsFile& f, const TensorEntry& e);

}  // namespace blu::test
