// A small HTTP/1.1 server for operators' endpoints: Prometheus' /metrics, the live page and its
// JSON. GET and HEAD only, one request per connection (Connection: close), bounded requests.
//
// Threads: the server runs its own io_context on its own thread; handlers run there, one at a
// time, so they must be quick and must only read state that is safe to read from another
// thread (a metrics registry, a snapshot the owner publishes).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muster::ops {

// Bounds (docs/operations.md): a request line and headers larger than this get 431; a client
// that has not sent its request within the read timeout is dropped; at most this many
// connections are open at once (more wait in the kernel's backlog).
inline constexpr std::size_t kMaxHttpRequestBytes = 8 * 1024;
inline constexpr std::chrono::milliseconds kHttpReadTimeout{5000};
inline constexpr std::size_t kMaxHttpConnections = 64;

struct HttpRequest {
  std::string method;  // "GET" or "HEAD"
  std::string path;    // without the query
  std::string query;   // after '?', undecoded; empty when none
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;
// Exact paths ("/metrics"); anything else is 404.
using HttpRoutes = std::map<std::string, HttpHandler>;

class HttpServer {
 public:
  // Listens on host (an IP address; "0.0.0.0" for every interface) and port (0: a free one)
  // and serves `routes` until stopped. Fails with the address in the message when it cannot.
  static absl::StatusOr<std::unique_ptr<HttpServer>> start(const std::string& host, int port,
                                                           HttpRoutes routes);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Closes the listener and every connection, joins the thread. Safe to call twice; not from
  // a handler.
  void stop();

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A query parameter's value ("run" in "run=a&x=1"), percent-decoded; empty when absent.
std::string query_param(const std::string& query, const std::string& name);

}  // namespace muster::ops
