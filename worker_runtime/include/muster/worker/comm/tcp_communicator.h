// The TCP ring backend (Boost.Asio): what runs on machines without GPUs.
//
// all_reduce is a ring reduce-scatter followed by a ring all-gather over n uneven segments,
// run as one stream: the segment a rank receives in one step is the one it sends in the next,
// so each chunk is reduced as it lands and forwarded at once. broadcast is a pipeline along
// the ring. f16/bf16 are widened to f32 for the reduction. Ranks find each other through the
// store: each listens on a free TCP port (and an abstract Unix-domain name) and publishes
// "tcp/<rank>" = "host:port|host-identity|unix-name"; ranks on the same machine (and network
// namespace) connect over the Unix socket, others over TCP. Every connection starts with a magic number, the sender's rank
// and the group size.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "muster/rendezvous/store.h"
#include "muster/worker/comm/communicator.h"

namespace muster::worker {

struct TcpOptions {
  std::string listen_host = "0.0.0.0";
  std::string advertise_host = "127.0.0.1";  // how the others reach this rank
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // per call and for set-up
  std::size_t chunk_bytes = 2048 * 1024;  // the largest pipeline chunk
  // When non-zero, a receive wakes only once this many bytes (or the rest of the segment) are
  // in (SO_RCVLOWAT). Fewer, larger wake-ups pay off when ranks outnumber the cores and every
  // wake-up preempts another rank; Runtime sets 1 MiB then (otherwise reading early overlaps
  // better: 2 ranks on 2 cores ran 17% slower at 16 MiB with it).
  std::size_t recv_low_water = 0;
  // Ranks on the same machine (same boot and network namespace) connect over an abstract Unix-domain socket
  // instead of TCP loopback (about 20% more bandwidth here); false: TCP between every pair.
  bool same_host_unix = true;
  // Set-up gives up with CANCELLED once this says so (asked every kSetupPollSlice while it
  // waits for a peer): an in-place re-form whose world changed again (control.h).
  std::function<bool()> cancelled;
};

// How often a waiting set-up asks TcpOptions::cancelled.
inline constexpr std::chrono::milliseconds kSetupPollSlice{100};

// Builds the ring. Collective: every rank of the group calls it with the same store.
absl::StatusOr<std::unique_ptr<Communicator>> make_tcp_communicator(rendezvous::Store& store,
                                                                    int rank, int size,
                                                                    const TcpOptions& options);

}  // namespace muster::worker
