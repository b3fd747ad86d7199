// The operators' HTTP server (ops/http_server.h) over a real loopback socket.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "muster/ops/http_server.h"

namespace {

// Sends `request` raw and reads until the server closes.
std::string exchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  std::size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close early (a request over the cap)
    sent += static_cast<std::size_t>(n);
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

}  // namespace

TEST_CASE("http server: routes, 404, HEAD, bad method, query, oversized request", "[http]") {
  muster::ops::HttpRoutes routes;
  routes["/hello"] = [](const muster::ops::HttpRequest& r) {
    return muster::ops::HttpResponse{200, "text/plain", "hi " + muster::ops::query_param(r.query, "who")};
  };
  auto server = muster::ops::HttpServer::start("127.0.0.1", 0, routes);
  REQUIRE(server.ok());
  const int port = (*server)->port();
  REQUIRE(port > 0);

  const std::string ok = exchange(port, "GET /hello?x=1&who=a%20b HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(ok.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(ok.find("Content-Length: 6\r\n") != std::string::npos);
  CHECK(ok.substr(ok.size() - 6) == "hi a b");

  const std::string head = exchange(port, "HEAD /hello HTTP/1.1\r\n\r\n");
  CHECK(head.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  CHECK(head.substr(head.size() - 4) == "\r\n\r\n");  // headers only

  CHECK(exchange(port, "GET /nope HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404 ", 0) == 0);
  CHECK(exchange(port, "POST /hello HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405 ", 0) == 0);
  CHECK(exchange(port, "garbage\r\n\r\n").rfind("HTTP/1.1 400 ", 0) == 0);
  const std::string big = "GET /hello HTTP/1.1\r\nX: " +
                          std::string(muster::ops::kMaxHttpRequestBytes, 'a') + "\r\n\r\n";
  CHECK(exchange(port, big).rfind("HTTP/1.1 431 ", 0) == 0);

  (*server)->stop();
  (*server)->stop();  // twice is fine
}

TEST_CASE("http server: a taken port is an error naming the address", "[http]") {
  auto first = muster::ops::HttpServer::start("127.0.0.1", 0, {});
  REQUIRE(first.ok());
  auto second = muster::ops::HttpServer::start("127.0.0.1", (*first)->port(), {});
  REQUIRE_FALSE(second.ok());
  CHECK(std::string(second.status().message()).find("127.0.0.1:" + std::to_string((*first)->port())) !=
        std::string::npos);
  CHECK_FALSE(muster::ops::HttpServer::start("not-an-ip", 0, {}).ok());
}
