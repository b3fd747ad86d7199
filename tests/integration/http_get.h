// One HTTP GET on 127.0.0.1 for the integration tests (/metrics, the live page's JSON).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

namespace muster::testing {

// One HTTP exchange on 127.0.0.1 (HTTP/1.0: the server closes when done, no chunks); the
// status line and the body, or "" when nothing could be read within 10 s.
struct HttpReply {
  std::string status_line, body;
};
inline HttpReply http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  HttpReply reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return reply;
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const auto eol = out.find("\r\n");
  const auto head_end = out.find("\r\n\r\n");
  if (eol == std::string::npos || head_end == std::string::npos) return reply;
  reply.status_line = out.substr(0, eol);
  reply.body = out.substr(head_end + 4);
  return reply;
}

}  // namespace muster::testing
