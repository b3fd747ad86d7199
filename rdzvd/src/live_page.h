// rdzvd --http_port: the live page (docs/operations.md, "The live page"). One self-contained
// HTML page (no external assets: it works on an air-gapped cluster) that polls two JSON
// endpoints and updates in place:
//   /             the page
//   /api/status   the status document of `rdzvd status --json`
//   /api/events   ?since=N: the events numbered above N, from a bounded feed
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "muster/ops/http_server.h"
#include "muster/rendezvous/events.h"
#include "muster/rendezvous/server.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rdzvd {

// Bounds (docs/operations.md): the feed keeps the last kLivePageEvents events (older ones
// are dropped first; a page that fell behind is told so); /api/status waits at most
// kLivePageStatusTimeout for the server's io thread before it answers 503.
inline constexpr std::size_t kLivePageEvents = 1000;
inline constexpr std::chrono::milliseconds kLivePageStatusTimeout{2000};

// The recent events, numbered from 1 in the order the server decided them.
class EventFeed {
 public:
  // The server's io thread (an event sink).
  void add(const rendezvous::RunEvent& e) ABSL_LOCKS_EXCLUDED(mu_);
  // Any thread: {"next": N, "first": F, "dropped": bool, "events": [...]} with the events
  // numbered above `since`, oldest first. `next` is the number the next event will get;
  // `dropped` says events above `since` were no longer held.
  std::string json_since(std::uint64_t since) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::deque<std::pair<std::uint64_t, std::string>> ring_ ABSL_GUARDED_BY(mu_);  // seq, JSON
  std::uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
};

// What /api/status shows; called on the HTTP server's thread, must be bounded.
using StatusSource = std::function<absl::StatusOr<v1::StatusReply>()>;

// The server's status, taken on its io thread (RendezvousServer::post_status), waited for
// at most kLivePageStatusTimeout. `server` must outlive the source's use.
StatusSource status_source_of(rendezvous::RendezvousServer& server);

// The page's routes, for an ops::HttpServer (more, e.g. /metrics, may be added to them).
ops::HttpRoutes live_page_routes(std::shared_ptr<const EventFeed> feed, StatusSource status);

// The page itself (live_page_html.cc).
extern const char* const kLivePageHtml;

}  // namespace muster::rdzvd
