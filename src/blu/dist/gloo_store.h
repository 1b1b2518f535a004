// dist/gloo_store (internal to dist/): gloo's rendezvous::Store interface over TcpStore, so
// gloo::rendezvous::Context can exchange its pair addresses through the job's own store (Debian's
// Gloo ships file, hash, prefix and Redis stores, no TCP one). Includes gloo headers: only .cpp
// files that link gloo may include it.
// Depends on dist/tcp_store, gloo. Keep: the adapter owns nothing; the TcpStore outlives it.
#pragma once
#include <gloo/rendezvous/store.h>

#include "blu/dist/tcp_store.h"

namespace blu::dist {

class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(TcpStore& store) : store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string v = store_.get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  TcpStore& store_;
};

}  // namespace blu::dist
