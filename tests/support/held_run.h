// A rendezvous session that holds a run open on a server, for tests and benchmarks that use a
// run's store without a real agent: the store serves only runs the rendezvous holds. The
// session joins `run` as a one-node round and waits for its Assignment (so the run, and its
// store table, exist when the constructor returns); it sends no keep-alives, so its keep-alive
// interval is the largest a client may ask for. Destroying it leaves the run.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "muster/rendezvous/limits.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::testing {

class HeldRun {
 public:
  HeldRun(const std::string& endpoint, const std::string& run, int min_nodes = 1, int max_nodes = 1,
          const std::string& token = "")
      : stub_(v1::Rendezvous::NewStub(grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()))) {
    stream_ = stub_->Session(&ctx_);
    v1::AgentMsg m;
    v1::Join* j = m.mutable_join();
    j->set_run_id(run);
    j->set_node_id("held-" + run);
    j->set_host("127.0.0.1");
    j->set_local_world_size(1);
    j->set_min_nodes(min_nodes);
    j->set_max_nodes(max_nodes);
    j->set_requested_rank(-1);
    j->set_token(token);
    j->set_keep_alive_interval_ms(rendezvous::limits::kMaxKeepAliveInterval.count());
    v1::ServerMsg got;
    if (!stream_->Write(m) || !stream_->Read(&got) || !got.has_assignment()) {
      throw std::runtime_error("held run '" + run + "': no assignment from " + endpoint);
    }
    assignment_ = got.assignment();
  }
  const v1::Assignment& assignment() const { return assignment_; }
  ~HeldRun() {
    ctx_.TryCancel();
    stream_->Finish();
  }
  HeldRun(const HeldRun&) = delete;
  HeldRun& operator=(const HeldRun&) = delete;

 private:
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMsg, v1::ServerMsg>> stream_;
  v1::Assignment assignment_;
};

}  // namespace muster::testing
