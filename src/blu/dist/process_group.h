// dist/process_group: collectives between the ranks of a job behind one interface, so the
// data-parallel and ZeRO code never names an engine. Gloo (CPU tensors, over TCP) is implemented
// in process_group_gloo.cpp; NCCL (CUDA tensors, CUDA builds only) in process_group_nccl.cpp.
//   all_reduce(t, op)              t ← op over ranks of t                       (in place)
//   reduce_scatter(out, in, op)    out ← chunk `rank` of op over ranks of in; in.numel = size·out.numel
//   all_gather(out, in)            out ← cat over ranks of in;                  out.numel = size·in.numel
//   broadcast(t, root)             t ← root's t
//   send(t, dst, tag) / recv(t, src, tag)   point to point; tags pair a send with its recv; these
//                                  start at once on the caller's thread (not in the queue), and
//                                  is_completed() turns true only once wait() has returned
//   barrier()                      returns once every rank has entered it
// Every call is asynchronous: it checks its arguments, queues the operation and returns a Work;
// wait() blocks until it is done and rethrows its failure as blu::Error. Operations run in the
// order they were issued (one worker thread per group), so every rank must issue the same
// collectives in the same order — as with NCCL and torch.distributed.
// NCCL differs in when "done" means: its operations are queued on the group's communication
// stream (after the work already queued on the caller's current stream) and wait() makes the
// caller's current stream wait for them, without blocking the host (process_group_nccl.cpp).
// Depends on core/tensor, dist/tcp_store (bootstrap). Keep: tensors are contiguous,
// bf16/f16/f32/f64/i32/i64, on the CPU for Gloo (16-bit floats reduced in f32) and on this rank's
// device for NCCL (BLU_CHECK otherwise), and must stay alive and untouched until their Work
// completes; a peer that
// dies or stalls becomes an error on every surviving rank within the group's timeout, never a
// hang; after a failure the group is broken and every later call fails too. Both record every
// operation in the process's flight recorder (dist/flight_recorder.h) and dump it on a failure.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "blu/core/tensor.h"
#include "blu/dist/tcp_store.h"

namespace blu::dist {

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

// A queued or running operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; throws blu::Error if the operation failed (also on every later wait).
  virtual void wait() = 0;
  virtual bool is_completed() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "gloo", "nccl"
  // Operations issued from now on fail after `t`, and their errors name `phase` (what the ranks
  // are doing: "training step 12", "rank 0's checkpoint at step 10"). The trainer raises the
  // timeout around work of unbounded length (checkpoints) and names each phase.
  virtual void set_timeout(std::chrono::milliseconds t) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_phase(std::string phase) = 0;

  virtual WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum) = 0;
  virtual WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::sum) = 0;
  virtual WorkPtr all_gather(const Tensor& out, const Tensor& in) = 0;
  virtual WorkPtr broadcast(const Tensor& t, int root) = 0;
  virtual WorkPtr send(const Tensor& t, int dst, int tag = 0) = 0;
  virtual WorkPtr recv(const Tensor& t, int src, int tag = 0) = 0;
  virtual WorkPtr barrier() = 0;
};

struct GlooOptions {
  // Every operation (and the connection set-up) fails with an error after this long.
  std::chrono::milliseconds timeout{30000};
  // Interface address the ranks' sockets bind to; "" uses the address that reaches MASTER_ADDR
  // ("127.0.0.1" on one node).
  std::string hostname{};
  std::string prefix = "default_pg";  // store key prefix: several groups can share one store
};

// Connects `size` ranks full mesh over TCP, rendezvousing through `store` (which must outlive the
// set-up only). BLU_CHECK on bad arguments; blu::Error when a peer does not show up in time.
std::shared_ptr<ProcessGroup> make_gloo_group(TcpStore& store, int rank, int size, GlooOptions options = {});

struct NcclOptions {
  // An operation not done after this long aborts the communicator and breaks the group (every
  // later wait() and call throws blu::Error); 0 turns the watchdog off (a dead peer then hangs).
  std::chrono::milliseconds timeout{600000};
  int device = -1;             // the CUDA device of this rank; -1: LOCAL_RANK (dist/env)
  bool blocking_wait = false;  // wait() also blocks the host until the operation is done
  // The communication stream gets the device's highest priority: when compute kernels fill the
  // GPU, the block scheduler starts a queued collective's blocks first, so a DDP bucket's
  // all-reduce runs beside backward instead of waiting for SMs to drain (false: default priority).
  bool high_priority_stream = true;
  std::string prefix = "default_pg";  // store key prefix: several groups can share one store
  // ncclCommInitRank not done after this long ends the process with a message naming the rank and
  // the timeout (a blocking init cannot be aborted); 0: `timeout` (0 there too: not watched).
  std::chrono::milliseconds init_timeout{0};
  // The watchdog making no progress for this long (stuck in a CUDA or NCCL call) ends the process;
  // 0: no heartbeat monitor.
  std::chrono::milliseconds heartbeat_timeout{480000};
  // A group of two ranks on one host: all-reduces (sum, avg) of float tensors up to this many MiB
  // move through a window of the peer's memory by copy engine instead of NCCL's kernels
  // (dist/nccl_peer_window.h); 0: NCCL for everything. Unset (0), BLU_NCCL_PEER_WINDOW_MIB sets it.
  // Where the window cannot be mapped the group says why on stderr and uses NCCL.
  double peer_window_mib = 0;
};

// CUDA builds only (BLU_HAVE_CUDA). Makes `device` current, shares rank 0's ncclUniqueId through
// `store` and creates the communicator. BLU_CHECK on bad arguments; blu::Error from NCCL.
std::shared_ptr<ProcessGroup> make_nccl_group(TcpStore& store, int rank, int size, NcclOptions options = {});

}  // namespace blu::dist
