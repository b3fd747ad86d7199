#include "live_page.h"

#include <future>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "muster/ops/json.h"
#include "muster/status/status_format.h"

namespace muster::rdzvd {
namespace {

ops::HttpResponse json_response(int status, std::string body) {
  ops::HttpResponse r;
  r.status = status;
  r.content_type = "application/json";
  r.body = std::move(body);
  return r;
}

ops::HttpResponse json_error(int status, std::string_view message) {
  return json_response(status, ops::JsonObject().add("error", message).str());
}

}  // namespace

void EventFeed::add(const rendezvous::RunEvent& e) {
  const auto wall = muster::status::wall_time_of(e);
  absl::MutexLock lock(&mu_);
  const std::uint64_t seq = next_++;
  if (ring_.size() >= kLivePageEvents) ring_.pop_front();
  ring_.emplace_back(seq, muster::status::event_json(e, wall, seq));
}

std::string EventFeed::json_since(std::uint64_t since) const {
  absl::MutexLock lock(&mu_);
  const std::uint64_t first = ring_.empty() ? next_ : ring_.front().first;
  std::vector<std::string> events;
  for (const auto& [seq, json] : ring_) {
    if (seq > since) events.push_back(json);
  }
  return ops::JsonObject()
      .add("next", static_cast<long long>(next_))
      .add("first", static_cast<long long>(first))
      .add("dropped", since + 1 < first)
      .add_raw("events", ops::json_array(events))
      .str();
}

StatusSource status_source_of(rendezvous::RendezvousServer& server) {
  return [&server]() -> absl::StatusOr<v1::StatusReply> {
    // Shared with the io thread's task, which may run after this call gave up.
    auto answer = std::make_shared<std::promise<v1::StatusReply>>();
    std::future<v1::StatusReply> got = answer->get_future();
    server.post_status("",
                       [answer](v1::StatusReply reply) { answer->set_value(std::move(reply)); });
    if (got.wait_for(kLivePageStatusTimeout) != std::future_status::ready) {
      return absl::UnavailableError(absl::StrCat("the rendezvous server did not answer within ",
                                                 kLivePageStatusTimeout.count(), " ms"));
    }
    return got.get();
  };
}

ops::HttpRoutes live_page_routes(std::shared_ptr<const EventFeed> feed, StatusSource status) {
  ops::HttpRoutes routes;
  routes["/"] = [](const ops::HttpRequest&) {
    ops::HttpResponse r;
    r.content_type = "text/html; charset=utf-8";
    r.body = kLivePageHtml;
    return r;
  };
  routes["/api/status"] = [status = std::move(status)](const ops::HttpRequest&) {
    auto reply = status();
    if (!reply.ok()) return json_error(503, std::string(reply.status().message()));
    return json_response(200, muster::status::status_json(*reply));
  };
  routes["/api/events"] = [feed = std::move(feed)](const ops::HttpRequest& req) {
    const std::string since_text = ops::query_param(req.query, "since");
    std::uint64_t since = 0;
    if (!since_text.empty() && !absl::SimpleAtoi(since_text, &since)) {
      return json_error(400, "since: expected a non-negative integer");
    }
    return json_response(200, feed->json_since(since));
  };
  return routes;
}

}  // namespace muster::rdzvd
