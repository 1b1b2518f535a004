#include "blu/data/loader.h"

#include <glob.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "blu/core/error.h"
#include "blu/data/permute.h"
#include "blu/data/shard.h"

namespace blu {

// ---- LoaderState <-> JSON ----

void to_json(nlohmann::json& j, const LoaderState& s) {
  j = nlohmann::json{{"epoch", s.epoch},   {"shard", s.shard},
                     {"batch", s.batch},   {"shard_file", s.shard_file},
                     {"num_shards", s.num_shards}, {"B", s.B},
                     {"T", s.T},           {"world_size", s.world_size},
                     {"shuffle", s.shuffle}, {"seed", s.seed}};
}

namespace {
template <typename V>
void read_field(const nlohmann::json& j, const char* key, V& out) {
  BLU_CHECK(j.is_object(), "LoaderState: expected a JSON object, got ", j.type_name());
  BLU_CHECK(j.contains(key), "LoaderState: JSON has no field '", key, "': ", j.dump());
  // A number with a fraction or an exponent converts to an integer by a cast that is undefined
  // when it is out of range (1e300): integers only.
  if constexpr (std::is_integral_v<V> && !std::is_same_v<V, bool>)
    BLU_CHECK(!j.at(key).is_number_float(), "LoaderState: field '", key, "' must be an integer, got ", j.at(key).dump());
  try {
    out = j.at(key).get<V>();
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, "LoaderState: field '", key, "' has the wrong type (", j.at(key).type_name(), "): ", e.what());
  }
}
}  // namespace

void from_json(const nlohmann::json& j, LoaderState& s) {
  read_field(j, "epoch", s.epoch);
  read_field(j, "shard", s.shard);
  read_field(j, "batch", s.batch);
  read_field(j, "shard_file", s.shard_file);
  read_field(j, "num_shards", s.num_shards);
  read_field(j, "B", s.B);
  read_field(j, "T", s.T);
  read_field(j, "world_size", s.world_size);
  read_field(j, "shuffle", s.shuffle);
  read_field(j, "seed", s.seed);
}

// ---- file discovery ----

std::vector<std::filesystem::path> expand_shard_pattern(const std::string& pattern) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::filesystem::path> files;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) {
      std::filesystem::path p = g.gl_pathv[i];
      if (std::filesystem::is_regular_file(p)) files.push_back(p);
    }
  }
  ::globfree(&g);
  BLU_CHECK(rc == 0 || rc == GLOB_NOMATCH, "DataLoader: cannot expand pattern '", pattern, "' (glob error ", rc, ")");
  BLU_CHECK(!files.empty(), "DataLoader: no shard files match '", pattern, "'");
  std::sort(files.begin(), files.end());  // byte order, whatever the locale
  return files;
}

// ---- loader ----

struct DataLoader::ReadCache {
  int64_t file = -1;  // index into files_ of the mapped shard
  std::optional<ShardReader> reader;
  int64_t order_epoch = -1;
  std::vector<int64_t> order;
  int64_t perm_epoch = -1, perm_file = -1;  // shuffle mode: window permutation of (epoch, file)
  std::vector<int64_t> perm;
};

namespace {
constexpr uint64_t kShardOrderTag = 0x5348415244ull;  // "SHARD"
constexpr uint64_t kWindowTag = 0x57494e444f57ull;    // "WINDOW"
}  // namespace

DataLoader::DataLoader(const std::string& pattern, int64_t B, int64_t T, int rank, int world_size,
                       LoaderOptions options)
    : DataLoader(expand_shard_pattern(pattern), B, T, rank, world_size, options) {}

DataLoader::DataLoader(const std::vector<std::filesystem::path>& files, int64_t B, int64_t T, int rank,
                       int world_size, LoaderOptions options)
    : files_(files), B_(B), T_(T), rank_(rank), world_size_(world_size), options_(options) {
  BLU_CHECK(B > 0 && T > 0, "DataLoader: B and T must be positive, got B=", B, ", T=", T);
  BLU_CHECK(world_size > 0, "DataLoader: world_size must be positive, got ", world_size);
  BLU_CHECK(rank >= 0 && rank < world_size, "DataLoader: rank must be in [0, world_size=", world_size, "), got ",
            rank);
  BLU_CHECK(options.prefetch >= 0, "DataLoader: prefetch must be >= 0, got ", options.prefetch);
  BLU_CHECK(!files_.empty(), "DataLoader: no shard files given");
  BLU_CHECK(B <= (int64_t{1} << 40) / T / world_size, "DataLoader: B*T*world_size is too large (B=", B, ", T=", T,
            ", world_size=", world_size, ")");
  if (!options_.rows.empty()) {
    BLU_CHECK(int64_t(options_.rows.size()) == world_size, "DataLoader: rows must give one count per rank (",
              world_size, "), got ", options_.rows.size());
    BLU_CHECK(options_.rows[size_t(rank)] == B, "DataLoader: rows[", rank, "] = ", options_.rows[size_t(rank)],
              " must equal this rank's B = ", B);
    for (int r = 0; r < world_size; ++r) {
      BLU_CHECK(options_.rows[size_t(r)] > 0, "DataLoader: rows[", r, "] must be positive, got ", options_.rows[size_t(r)]);
      round_rows_ += options_.rows[size_t(r)];
      if (r < rank) row_offset_ += options_.rows[size_t(r)];
    }
    const bool even = std::all_of(options_.rows.begin(), options_.rows.end(), [&](int64_t n) { return n == B; });
    BLU_CHECK(even || !options_.shuffle, "DataLoader: uneven rows per rank read one contiguous round: shuffle is "
              "not supported with them (rows of rank 0: ", options_.rows[0], ", this rank: ", B, ")");
  } else {
    round_rows_ = B * world_size;
    row_offset_ = B * rank;
  }
  const int64_t round_tokens = round_rows_ * T;
  for (const auto& f : files_) {
    const int64_t n = read_shard_token_count(f);
    BLU_CHECK(n >= round_tokens + 1, "DataLoader: shard '", f.string(), "' has ", n,
              " tokens, too few for one batch on every rank: B*T*world_size+1 = ", round_tokens + 1,
              " are needed (B=", B, ", T=", T, ", world_size=", world_size, ")");
    shard_tokens_.push_back(n);
    shard_rounds_.push_back((n - 1) / round_tokens);
    batches_per_epoch_ += shard_rounds_.back();
  }
  sync_cache_ = std::make_unique<ReadCache>();
  start_thread();
}

DataLoader::~DataLoader() { stop_thread(); }

std::vector<int64_t> DataLoader::shard_order(int64_t epoch) const {
  const auto n = static_cast<int64_t>(files_.size());
  if (!options_.shuffle) {
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    return order;
  }
  return seeded_permutation(n, mix_seed(mix_seed(options_.seed, static_cast<uint64_t>(epoch)), kShardOrderTag));
}

DataLoader::Cursor DataLoader::advance(Cursor c) const {
  // The number of rounds depends on the file, and the file on the epoch's order.
  const int64_t file = shard_order(c.epoch)[c.shard];
  if (++c.batch < shard_rounds_[file]) return c;
  c.batch = 0;
  if (++c.shard < static_cast<int64_t>(files_.size())) return c;
  c.shard = 0;
  ++c.epoch;
  return c;
}

void DataLoader::fill(const Cursor& c, int32_t* inputs, int32_t* targets, ReadCache& cache) const {
  if (cache.order_epoch != c.epoch) {
    cache.order = shard_order(c.epoch);
    cache.order_epoch = c.epoch;
  }
  const int64_t file = cache.order[c.shard];
  if (cache.file != file) {
    cache.reader.reset();
    cache.file = -1;
    cache.reader.emplace(files_[file], options_.vocab_size);
    BLU_CHECK(cache.reader->size() == shard_tokens_[file], "DataLoader: shard '", files_[file].string(),
              "' changed since the loader opened it: it had ", shard_tokens_[file], " tokens, now ",
              cache.reader->size());
    cache.file = file;
  }
  const int64_t bt = B_ * T_;
  int64_t window = c.batch * world_size_ + rank_;
  if (options_.shuffle) {
    if (cache.perm_epoch != c.epoch || cache.perm_file != file) {
      const uint64_t s = mix_seed(mix_seed(mix_seed(options_.seed, static_cast<uint64_t>(c.epoch)),
                                           static_cast<uint64_t>(file)),
                                  kWindowTag);
      cache.perm = seeded_permutation(shard_rounds_[file] * world_size_, s);
      cache.perm_epoch = c.epoch;
      cache.perm_file = file;
    }
    window = cache.perm[window];
  }
  const uint16_t* w = options_.shuffle ? cache.reader->tokens().data() + window * bt
                                       : cache.reader->tokens().data() + (c.batch * round_rows_ + row_offset_) * T_;
  for (int64_t i = 0; i < bt; ++i) {
    inputs[i] = w[i];
    targets[i] = w[i + 1];
  }
}

// ---- prefetch thread ----

void DataLoader::start_thread() {
  if (options_.prefetch == 0) return;
  stop_ = false;
  thread_ = std::thread([this, c = next_] { produce_loop(c); });
}

void DataLoader::stop_thread() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ready_.clear();
}

void DataLoader::produce_loop(Cursor c) {
  ReadCache cache;
  const auto bt = static_cast<size_t>(B_ * T_);
  for (;;) {
    Item item;
    item.at = c;
    try {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!spare_.empty()) {
          item.batch = std::move(spare_.back());
          spare_.pop_back();
        }
      }
      item.batch.inputs.resize(bt);
      item.batch.targets.resize(bt);
      fill(c, item.batch.inputs.data(), item.batch.targets.data(), cache);
      c = advance(c);
    } catch (...) {
      item.batch = {};
      item.error = std::current_exception();
    }
    const bool failed = static_cast<bool>(item.error);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return stop_ || static_cast<int>(ready_.size()) < options_.prefetch; });
    if (stop_) return;
    ready_.push_back(std::move(item));
    lock.unlock();
    cv_.notify_all();
    if (failed) return;  // the error is the last item; restore() starts a new thread
  }
}

DataLoader::Item DataLoader::take() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !ready_.empty(); });
  Item item = std::move(ready_.front());
  ready_.pop_front();
  lock.unlock();
  cv_.notify_all();
  return item;
}

// ---- caller side ----

Batch DataLoader::next() {
  if (error_) std::rethrow_exception(error_);
  Batch out;
  if (options_.prefetch == 0) {
    const auto bt = static_cast<size_t>(B_ * T_);
    out.inputs.resize(bt);
    out.targets.resize(bt);
    fill(next_, out.inputs.data(), out.targets.data(), *sync_cache_);
  } else {
    Item item = take();
    if (item.error) {
      error_ = item.error;
      std::rethrow_exception(error_);
    }
    BLU_ASSERT(item.at == next_, "prefetched batch is out of order");
    out = std::move(item.batch);
  }
  next_ = advance(next_);
  return out;
}

void DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const auto bt = static_cast<size_t>(B_ * T_);
  BLU_CHECK(inputs.size() == bt && targets.size() == bt, "DataLoader::next: buffers must hold B*T = ", bt,
            " tokens each (B=", B_, ", T=", T_, "), got inputs ", inputs.size(), " and targets ", targets.size());
  if (error_) std::rethrow_exception(error_);
  if (options_.prefetch == 0) {
    fill(next_, inputs.data(), targets.data(), *sync_cache_);
  } else {
    Item item = take();
    if (item.error) {
      error_ = item.error;
      std::rethrow_exception(error_);
    }
    BLU_ASSERT(item.at == next_, "prefetched batch is out of order");
    std::copy(item.batch.inputs.begin(), item.batch.inputs.end(), inputs.begin());
    std::copy(item.batch.targets.begin(), item.batch.targets.end(), targets.begin());
    std::lock_guard<std::mutex> lock(mu_);
    spare_.push_back(std::move(item.batch));
  }
  next_ = advance(next_);
}

LoaderState DataLoader::state() const {
  LoaderState s;
  s.epoch = next_.epoch;
  s.shard = next_.shard;
  s.batch = next_.batch;
  s.shard_file = files_[shard_order(next_.epoch)[next_.shard]].filename().string();
  s.num_shards = static_cast<int64_t>(files_.size());
  const bool uneven = round_rows_ != B_ * world_size_;
  s.B = uneven ? round_rows_ : B_;
  s.T = T_;
  s.world_size = uneven ? 1 : world_size_;
  s.shuffle = options_.shuffle;
  s.seed = options_.seed;
  return s;
}

void DataLoader::restore(const LoaderState& s) {
  auto mismatch = [&](const char* what, auto saved, auto ours) {
    BLU_CHECK(saved == ours, "DataLoader::restore: the state was saved with ", what, "=", saved,
              ", this loader has ", what, "=", ours);
  };
  mismatch("T", s.T, T_);
  mismatch("shuffle", s.shuffle, options_.shuffle);
  if (options_.shuffle) {  // shuffled windows are B*T tokens: another B reorders them; the seed orders them
    mismatch("seed", s.seed, options_.seed);
    mismatch("B", s.B, B_);
    mismatch("world_size", s.world_size, static_cast<int64_t>(world_size_));
  }
  // Another split of the same rounds (Note [Resuming on other ranks]).
  int64_t saved_rows = 0;  // checked: the numbers come from a file
  const bool rows_fit = !__builtin_mul_overflow(s.B, s.world_size, &saved_rows);
  BLU_CHECK(s.B > 0 && s.world_size > 0 && rows_fit && saved_rows == round_rows_,
            "DataLoader::restore: the state was saved with B=", s.B, " on world_size=", s.world_size, " (",
            rows_fit ? std::to_string(saved_rows) : std::string("more than int64 holds"),
            " rows a round), this loader has B=", B_, " on world_size=", world_size_, " (", round_rows_,
            " rows): to resume on another number of ranks keep B x world_size, the global batch");
  mismatch("num_shards", s.num_shards, static_cast<int64_t>(files_.size()));
  BLU_CHECK(s.epoch >= 0 && s.shard >= 0 && s.shard < s.num_shards, "DataLoader::restore: bad position epoch=",
            s.epoch, ", shard=", s.shard, " of ", s.num_shards);
  const int64_t file = shard_order(s.epoch)[s.shard];
  const std::string name = files_[file].filename().string();
  BLU_CHECK(s.shard_file.empty() || s.shard_file == name, "DataLoader::restore: the state points at shard '",
            s.shard_file, "' but this loader's shard at that position is '", name, "' (different data?)");
  BLU_CHECK(s.batch >= 0 && s.batch < shard_rounds_[file], "DataLoader::restore: batch ", s.batch,
            " is outside shard '", name, "', which has ", shard_rounds_[file], " batches");

  stop_thread();
  spare_.clear();
  next_ = Cursor{s.epoch, s.shard, s.batch};
  error_ = nullptr;
  start_thread();
}

void DataLoader::reset() {
  LoaderState s = state();
  s.epoch = 0;
  s.shard = 0;
  s.batch = 0;
  s.shard_file.clear();
  restore(s);
}

}  // namespace blu
