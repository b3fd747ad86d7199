// Worker-runtime benchmarks, driven by bench/run.
//   comm_bench allreduce          under `launch`: all_reduce float32 of 1, 16 and 64 MiB on the
//                                 TCP ring; rank 0 prints "allreduce <MiB> <bus GB/s>" for each
//   comm_bench store TARGET N ID  one store client: connects, prints "ready", waits for a line
//                                 on stdin, then N set+get pairs on its own keys; prints
//                                 "store <ops> <seconds>"
//   comm_bench hog TARGET KEYS    another run ("hog") parks one wait on KEYS missing keys;
//                                 prints "ready" once the server holds it, exits at EOF
#include <chrono>
#include <cstdio>
#include <thread>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "muster/rendezvous/client.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "muster/worker/runtime.h"

using namespace muster::worker;
using Clock = std::chrono::steady_clock;

namespace {

// The server's store serves only runs the rendezvous holds: each client holds its run
// ("bench") with a session of its own (the first forms the round, the others wait as spares).
class BenchRun {
 public:
  BenchRun(const std::string& target, const std::string& id, const std::string& run = "bench")
      : stub_(muster::v1::Rendezvous::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))),
        stream_(stub_->Session(&ctx_)) {
    muster::v1::AgentMsg m;
    auto* j = m.mutable_join();
    j->set_run_id(run);
    j->set_node_id(id);
    j->set_host("127.0.0.1");
    j->set_local_world_size(1);
    j->set_min_nodes(1);
    j->set_max_nodes(1);
    j->set_requested_rank(-1);
    j->set_keep_alive_interval_ms(600000);  // the benchmark sends no keep-alives
    ok_ = stream_->Write(m);
  }
  ~BenchRun() {
    ctx_.TryCancel();
    stream_->Finish();
  }
  bool ok() const { return ok_; }

 private:
  std::unique_ptr<muster::v1::Rendezvous::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<muster::v1::AgentMsg, muster::v1::ServerMsg>> stream_;
  bool ok_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "allreduce") {
    auto rt = Runtime::from_env();
    if (!rt.ok()) return 2;
    auto comm = (*rt)->communicator(Backend::kTcp);
    if (!comm.ok()) return 2;
    Communicator& c = **comm;
    const int n = c.size();
    for (int mib : {1, 16, 64}) {
      const std::size_t count = static_cast<std::size_t>(mib) << 18;  // floats
      std::vector<float> buf(count, 1.0f);
      const int iters = mib == 1 ? 40 : (mib == 16 ? 10 : 4);
      if (!c.all_reduce(buf.data(), count, DType::kF32, ReduceOp::kSum).ok()) return 1;  // warm-up
      if (!c.barrier().ok()) return 1;
      auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        if (!c.all_reduce(buf.data(), count, DType::kF32, ReduceOp::kSum).ok()) return 1;
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      const double bus = 2.0 * (n - 1) / n * count * sizeof(float) / s / 1e9;
      if (c.rank() == 0) std::printf("allreduce %d %.3f\n", mib, bus);
    }
    return 0;
  }
  if (mode == "store" && argc == 5) {
    const std::string id = argv[4];
    BenchRun run(argv[2], id);
    if (!run.ok()) return 1;
    muster::rendezvous::GrpcStore store({argv[2], "bench", ""});
    const int n = std::atoi(argv[3]);
    const std::string value(16, 'v');
    // Connected and warm (the first get waits for the run to exist on the server), then wait
    // for the runner's "go" so all clients start together.
    for (int attempt = 0; !store.set(id + "/warm", value).ok() ||
                          !store.get(id + "/warm", std::chrono::seconds(10)).ok();
         ++attempt) {
      if (attempt == 100) return 1;
    }
    std::printf("ready\n");
    std::fflush(stdout);
    std::string line;
    if (!std::getline(std::cin, line)) return 1;
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      const std::string key = id + "/" + std::to_string(i);
      if (!store.set(key, value).ok()) return 1;
      if (!store.get(key, std::chrono::seconds(10)).ok()) return 1;
    }
    std::printf("store %d %.6f\n", 2 * n, std::chrono::duration<double>(Clock::now() - t0).count());
    return 0;
  }
  if (mode == "hog" && argc == 4) {
    BenchRun run(argv[2], "hog", "hog");
    if (!run.ok()) return 1;
    std::vector<std::string> keys;
    for (int i = 0, n = std::atoi(argv[3]); i < n; ++i) keys.push_back("missing/" + std::to_string(i));
    muster::rendezvous::GrpcStore store({argv[2], "hog", ""});
    // The run may not be open on the server yet when the first request arrives: retry.
    for (int attempt = 0; !store.check({"x"}).ok(); ++attempt) {
      if (attempt == 100) return 1;
    }
    std::thread waiter([&] { (void)store.wait(keys, std::chrono::hours(1)); });
    waiter.detach();  // ends with the process
    for (int attempt = 0;; ++attempt) {
      auto st = muster::rendezvous::get_status(argv[2], "hog", "", std::chrono::seconds(5));
      if (st.ok() && st->store().parked_waits() >= 1) break;
      if (attempt == 1000) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::printf("ready\n");
    std::fflush(stdout);
    std::string line;
    std::getline(std::cin, line);
    std::_Exit(0);  // the parked wait goes with the process
  }
  std::fprintf(stderr, "usage: comm_bench allreduce | store TARGET N ID | hog TARGET KEYS\n");
  return 2;
}
