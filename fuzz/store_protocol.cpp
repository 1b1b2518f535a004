// Fuzz target: the TCP store server's reading of a connection (dist/store_protocol): the input is
// what one client sent — a hello, then requests — parsed as the server parses it, stage by stage,
// with each request applied to a key-value table with small caps. A real hello's nonce, a proof
// of the secret and the sockets are not in the way, so the fuzzer reaches every request kind.
#include "blu/dist/store_protocol.h"
#include "fuzz_util.h"

namespace {

using namespace blu::dist;

constexpr uint32_t kMaxKey = 64, kMaxValue = 256;

}  // namespace

BLU_FUZZ_TARGET({
  std::string_view in = blu::fuzz::as_text(data, size);
  StoreHello hello;
  const StoreParse h = parse_store_hello(in, "blutrain", hello);
  if (h.kind != StoreParse::message) {
    // An input without a valid hello still drives the request parser: one byte picks the stage.
    if (in.empty() || in[0] != 'R') return 0;
    in.remove_prefix(1);
  } else {
    if (h.used > in.size() || h.used > kStoreMaxHelloBytes || hello.job != "blutrain") std::abort();
    in.remove_prefix(h.used);
  }
  StoreTable table(StoreLimits{8, 1024});
  for (;;) {
    StoreRequest r;
    const StoreParse p = parse_store_request(in, kMaxKey, kMaxValue, r);
    if (p.kind != StoreParse::message) break;
    if (p.used > in.size() || p.used > store_request_max_bytes(kMaxKey, kMaxValue) || r.key.size() > kMaxKey ||
        r.value.size() > kMaxValue)
      std::abort();
    in.remove_prefix(p.used);
    const size_t keys = table.size(), bytes = table.total_bytes();
    const StoreTable::Result res = table.apply(r);
    if (table.size() > 8 || table.total_bytes() > 1024) std::abort();  // the caps hold
    if (res.kind == StoreTable::Result::refuse && (table.size() != keys || table.total_bytes() != bytes))
      std::abort();  // a refused request changes nothing
  }
})
