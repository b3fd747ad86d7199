#include "client/relay_upstream.h"

#include <boost/asio/post.hpp>

namespace muster::rendezvous {

namespace asio = boost::asio;

void RelayUpstream::begin(v1::StoreRelay::Stub* stub) {
  stub->async()->Relay(&ctx_, this);
  AddHold();
  StartRead(&down_);
  bool start = false;
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
    if (!writing_) {
      writing_ = true;
      take_batch();
      start = true;
    }
  }
  if (start) StartWrite(&sending_);
  StartCall();
}

void RelayUpstream::OnReadDone(bool ok) {
  if (!ok) {  // the loop gives the stream up; OnDone follows
    asio::post(io_, [this] { sink_->on_lost(this); });
    return;
  }
  auto msg = std::make_shared<v1::RelayDown>();
  msg->Swap(&down_);
  asio::post(io_, [this, msg] {
    sink_->on_down(this, *msg);
    bool more = false;
    {
      absl::MutexLock lock(&mu_);
      more = !abandoned_;
    }
    if (more) StartRead(&down_);
  });
}

void RelayUpstream::OnWriteDone(bool ok) {
  bool start = false, wake = false;
  {
    absl::MutexLock lock(&mu_);
    if (ok && !abandoned_ && !pending_.empty()) {
      take_batch();
      start = true;
    } else {
      writing_ = false;
    }
    if (wake_below_ && pending_bytes_ <= *wake_below_ && !abandoned_) {
      wake_below_.reset();
      wake = true;
    }
  }
  if (start) StartWrite(&sending_);
  // Before OnDone's post, so `this` is still there when it runs.
  if (wake) asio::post(io_, [this] { sink_->drained(this); });
}

void RelayUpstream::OnDone(const grpc::Status& s) {
  asio::post(io_, [this, s] {
    sink_->ended(s);
    sink_->upstream_done();
    delete this;
  });
}

}  // namespace muster::rendezvous
