// data/loader: batches of (inputs, targets) token ids from token shards, for one rank of a
// data-parallel job, in the manner of llm.c's DistributedDataLoader.
//   Each batch is one window of B*T+1 consecutive tokens: inputs = window[0, B*T),
//   targets = window[1, B*T+1), both as int32, row-major (B rows of T).
//   A shard of N tokens holds R = (N-1) / (B*T*world_size) rounds; in round k, rank r reads window
//   number k*world_size + r (window j starts at token j*B*T). The tail of a shard that cannot feed
//   every rank is skipped, then the next shard starts; after the last shard the epoch counter
//   increases and reading wraps to the first. Shuffle mode permutes, per epoch and from the seed,
//   the shard order and the windows within each shard; ranks still read disjoint windows.
//   Uneven rows (LoaderOptions::rows, data parallelism over replicas of unequal speed): rank r
//   reads rows[r] rows; a round is the sum(rows)·T contiguous tokens and rank r's rows start after
//   those of ranks 0..r-1, so the ranks together still read one global batch of sum(rows) rows —
//   the same tokens a single process with that batch reads. Sequential mode only.
// Depends on data/shard, core/error, nlohmann::json (LoaderState), a background thread.
// Keep: state() describes the next batch the caller will receive (never the prefetch thread's
// position), and restore(state()) followed by next() gives exactly the batches that would have
// followed; the batch sequence is a pure function of (files, B, T, rank, world_size, shuffle, seed).
//
// Note [Resuming on other ranks]
// In sequential mode a round is the B*T*world_size contiguous tokens from round_index*B*T*world_size
// on, and rank r reads its r-th B*T; the rounds of a shard, and so the whole sequence of rounds,
// depend only on B*world_size (and T). So a state restores into a loader with another world_size
// and B as long as B*world_size is the same: the ranks then read the same rounds, split among them
// differently — the same global batches, as data-parallel training averages them. Shuffle mode
// permutes windows of B*T tokens, so there B and world_size must each match.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace blu {

struct LoaderOptions {
  bool shuffle = false;
  uint64_t seed = 0;
  int prefetch = 2;        // batches prepared ahead on a background thread; 0 reads on the caller's thread
  int64_t vocab_size = 0;  // > 0: every token of a shard is checked when the loader first maps it
  // Rows per rank, world_size entries with rows[rank] == B (empty: B on every rank). Uneven counts
  // need sequential mode (shuffle off).
  std::vector<int64_t> rows;
};

// Where the next batch comes from, plus the settings it is only meaningful under (restore checks
// them; Note [Resuming on other ranks]). The same for every rank: ranks advance in lockstep.
struct LoaderState {
  int64_t epoch = 0;
  int64_t shard = 0;  // position in this epoch's shard order (the file order unless shuffling)
  int64_t batch = 0;  // round within that shard; the shard's first token read is batch*B*T*world_size
                      // (sequential mode) plus rank*B*T
  std::string shard_file;  // file name of that shard, a check that the data did not change
  int64_t num_shards = 0;
  int64_t B = 0;            // uneven rows (LoaderOptions::rows): the round's rows, world_size 1
  int64_t T = 0;
  int64_t world_size = 0;
  bool shuffle = false;
  uint64_t seed = 0;
  bool operator==(const LoaderState&) const = default;
};
void to_json(nlohmann::json& j, const LoaderState& s);
void from_json(const nlohmann::json& j, LoaderState& s);

struct Batch {
  std::vector<int32_t> inputs;   // B*T
  std::vector<int32_t> targets;  // B*T, inputs shifted by one token
};

// The shard files a glob pattern names, sorted. Throws if none match.
std::vector<std::filesystem::path> expand_shard_pattern(const std::string& pattern);

class DataLoader {
 public:
  DataLoader(const std::string& pattern, int64_t B, int64_t T, int rank, int world_size,
             LoaderOptions options = {});
  DataLoader(const std::vector<std::filesystem::path>& files, int64_t B, int64_t T, int rank, int world_size,
             LoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Not thread-safe: one caller thread at a time. Errors from the prefetch thread are rethrown
  // here, and again on every later call until restore() or reset(). Without prefetch an error is
  // thrown directly and the position does not move.
  Batch next();
  void next(std::span<int32_t> inputs, std::span<int32_t> targets);

  LoaderState state() const;
  void restore(const LoaderState& state);
  void reset();  // back to the first batch of epoch 0

  const std::vector<std::filesystem::path>& files() const { return files_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }  // per rank
  int64_t B() const { return B_; }
  int64_t T() const { return T_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  struct Cursor {
    int64_t epoch = 0, shard = 0, batch = 0;
    bool operator==(const Cursor&) const = default;
  };
  // What the reading side keeps between batches: the mapped shard and the current permutations.
  struct ReadCache;
  struct Item {
    Cursor at;
    Batch batch;
    std::exception_ptr error;
  };

  std::vector<int64_t> shard_order(int64_t epoch) const;
  Cursor advance(Cursor c) const;
  void fill(const Cursor& c, int32_t* inputs, int32_t* targets, ReadCache& cache) const;
  void start_thread();
  void stop_thread();
  void produce_loop(Cursor c);
  Item take();

  std::vector<std::filesystem::path> files_;
  std::vector<int64_t> shard_tokens_;  // per file, from the header at construction
  std::vector<int64_t> shard_rounds_;  // per file
  int64_t B_, T_;
  int rank_, world_size_;
  LoaderOptions options_;
  int64_t round_rows_ = 0, row_offset_ = 0;  // rows of a round over all ranks; this rank's first row
  int64_t batches_per_epoch_ = 0;

  Cursor next_;  // the next batch the caller receives
  std::exception_ptr error_;
  std::unique_ptr<ReadCache> sync_cache_;  // used when prefetch == 0

  // Prefetch thread and its bounded queue.
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> ready_;
  std::vector<Batch> spare_;  // buffers handed back by next(span, span), reused by the thread
  bool stop_ = false;
};

}  // namespace blu
