// The store relay's stream to the server (store_relay.h): frames up in batches, what comes
// down handed to the loop. Private to client/store_relay*.cc.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>

#include <boost/asio/io_context.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/limits.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

class RelayUpstream;

// What a stream hands back, on the loop's thread.
class RelayUpstreamSink {
 public:
  virtual ~RelayUpstreamSink() = default;
  // What the server sent.
  virtual void on_down(RelayUpstream* up, v1::RelayDown& msg) = 0;
  // The stream broke (a read failed); OnDone follows.
  virtual void on_lost(RelayUpstream* up) = 0;
  // The stream took its queue down below half of what full() was asked with.
  virtual void drained(RelayUpstream* up) = 0;
  // The call ended with `s`; then upstream_done, after which the stream is gone.
  virtual void ended(const grpc::Status& s) = 0;
  virtual void upstream_done() = 0;
};

// The stream to the server. Its reactions run on gRPC's threads and hand over to the loop
// (the sink's calls, on the io_context's thread); a hold keeps it until the loop gives it up
// (abandon).
class RelayUpstream final : public grpc::ClientBidiReactor<v1::RelayUp, v1::RelayDown> {
 public:
  RelayUpstream(std::shared_ptr<RelayUpstreamSink> sink, boost::asio::io_context& io)
      : sink_(std::move(sink)), io_(io) {}

  void begin(v1::StoreRelay::Stub* stub);
  // Frames up (the loop's thread). The first message carries the run and the token.
  // `later`: a write nobody waits on (a SET), sent with the next frame that is not, or by
  // kick() (the relay's write-behind timer).
  void send(v1::RelayFrame frame, bool later = false) {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      if (abandoned_) return;
      pending_bytes_ += frame.ByteSizeLong();
      pending_.push_back(std::move(frame));
      if (!later && !writing_ && started_) {
        writing_ = true;
        take_batch();
        start = true;
      }
    }
    if (start) StartWrite(&sending_);
  }
  // Sends what waits (frames sent `later`).
  void kick() {
    {
      absl::MutexLock lock(&mu_);
      if (abandoned_ || writing_ || !started_ || pending_.empty()) return;
      writing_ = true;
      take_batch();
    }
    StartWrite(&sending_);
  }
  // Whether more than `bound` bytes wait for the stream; if so, the loop is told (drained())
  // once the stream has taken them down to half of it.
  bool full(std::size_t bound) {
    absl::MutexLock lock(&mu_);
    if (pending_bytes_ <= bound) return false;
    wake_below_ = bound / 2;
    return true;
  }
  // The loop is done with it: the call is cancelled and the object goes with OnDone.
  void abandon() {
    {
      absl::MutexLock lock(&mu_);
      if (abandoned_) return;
      abandoned_ = true;
    }
    ctx_.TryCancel();
    RemoveHold();
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

  grpc::ClientContext ctx_;
  v1::RelayUp first_;
  v1::RelayDown down_;

 private:
  void take_batch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sending_.Clear();
    std::size_t bytes = 0;
    if (!first_sent_) {
      sending_.Swap(&first_);
      first_sent_ = true;
      bytes = sending_.ByteSizeLong();
    }
    while (!pending_.empty() && (bytes == 0 || bytes + pending_.front().ByteSizeLong() <=
                                                   limits::kRelayBatchBytes)) {
      const std::size_t n = pending_.front().ByteSizeLong();
      bytes += n;
      pending_bytes_ -= std::min(pending_bytes_, n);
      *sending_.add_frames() = std::move(pending_.front());
      pending_.pop_front();
    }
  }

  std::shared_ptr<RelayUpstreamSink> sink_;  // kept until OnDone
  boost::asio::io_context& io_;
  absl::Mutex mu_;
  std::deque<v1::RelayFrame> pending_ ABSL_GUARDED_BY(mu_);
  std::size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RelayUp sending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool first_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::size_t> wake_below_ ABSL_GUARDED_BY(mu_);  // full() said yes
};

}  // namespace muster::rendezvous
