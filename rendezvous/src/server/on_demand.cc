#include "server/on_demand.h"

#include <arpa/inet.h>
#include <grpcpp/server_posix.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::rendezvous::server_internal {
namespace {

absl::Status errno_status(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// The backlog gRPC's own listeners use (SOMAXCONN is the kernel's cap anyway).
constexpr int kBacklog = 4096;
// How long the listener waits before accepting again when it is out of descriptors.
constexpr int kAcceptBackoffMs = 100;

}  // namespace

absl::StatusOr<std::unique_ptr<OnDemandListener>> OnDemandListener::open(
    const std::string& ipv4_address, const std::string& abstract_name, Build build) {
  const std::string where = absl::StrCat("rendezvous server cannot listen on ", ipv4_address);
  const std::size_t colon = ipv4_address.rfind(':');
  int port = 0;
  sockaddr_in in{};
  in.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(ipv4_address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      ::inet_pton(AF_INET, ipv4_address.substr(0, colon).c_str(), &in.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an IPv4 address and port"));
  }
  in.sin_port = htons(static_cast<std::uint16_t>(port));
  std::unique_ptr<OnDemandListener> l(new OnDemandListener());
  l->build_ = std::move(build);
  l->tcp_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l->tcp_fd_ < 0) return errno_status(where);
  const int one = 1;
  ::setsockopt(l->tcp_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(l->tcp_fd_, reinterpret_cast<const sockaddr*>(&in), sizeof in) != 0 ||
      ::listen(l->tcp_fd_, kBacklog) != 0) {
    return errno_status(where);
  }
  socklen_t len = sizeof in;
  if (::getsockname(l->tcp_fd_, reinterpret_cast<sockaddr*>(&in), &len) != 0) {
    return errno_status(where);
  }
  l->port_ = ntohs(in.sin_port);
  if (!abstract_name.empty()) {
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    if (abstract_name.size() + 1 > sizeof un.sun_path) {
      return absl::InvalidArgumentError("abstract socket name too long");
    }
    std::memcpy(un.sun_path + 1, abstract_name.data(), abstract_name.size());
    // gRPC's unix-abstract: addresses are this long (no terminating NUL).
    const auto un_len =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + abstract_name.size());
    l->unix_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (l->unix_fd_ < 0 ||
        ::bind(l->unix_fd_, reinterpret_cast<const sockaddr*>(&un), un_len) != 0 ||
        ::listen(l->unix_fd_, kBacklog) != 0) {
      return errno_status(
          absl::StrCat("rendezvous server cannot listen on unix-abstract:", abstract_name));
    }
  }
  l->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (l->wake_fd_ < 0) return errno_status("eventfd");
  l->thread_ = std::thread([raw = l.get()] { raw->run(); });
  return l;
}

OnDemandListener::~OnDemandListener() {
  stop();
  for (int fd : {tcp_fd_, unix_fd_, wake_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

void OnDemandListener::stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (wake_fd_ >= 0) {
    const std::uint64_t one = 1;
    ssize_t unused = ::write(wake_fd_, &one, sizeof one);
    (void)unused;
  }
  if (thread_.joinable()) thread_.join();
  // Closed now, not at destruction: a client that connects after the stop is refused.
  for (int* fd : {&tcp_fd_, &unix_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void OnDemandListener::run() {
  pollfd fds[3] = {{wake_fd_, POLLIN, 0}, {tcp_fd_, POLLIN, 0}, {unix_fd_, POLLIN, 0}};
  const nfds_t n = unix_fd_ >= 0 ? 3 : 2;
  // Out of descriptors (or memory), a pending connection stays readable but cannot be taken:
  // accept is tried again after kAcceptBackoffMs, not at once, so the thread does not spin.
  int wait_ms = -1;
  bool said = false;
  for (;;) {
    // Backing off: only the wake fd is watched, for wait_ms; else every listener, no timeout.
    if (::poll(fds, wait_ms < 0 ? n : 1, wait_ms) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("rendezvous: poll on the listeners failed: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    wait_ms = -1;
    for (nfds_t i = 1; i < n; ++i) {
      for (;;) {
        const int fd = ::accept4(fds[i].fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            if (!said) {
              spdlog::warn("rendezvous: cannot accept a connection: {}; trying again every {} ms",
                           std::strerror(errno), kAcceptBackoffMs);
              said = true;
            }
            wait_ms = kAcceptBackoffMs;
          }
          break;  // EAGAIN: all taken; a client gone before it was taken: the next one
        }
        said = false;
        if (i == 1) {
          const int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        }
        serve(fd);
      }
    }
  }
}

void OnDemandListener::serve(int fd) {
  if (!server_ && !build_failed_) {
    server_ = build_();
    build_failed_ = server_ == nullptr;
    if (build_failed_) spdlog::error("rendezvous: the gRPC server could not be started");
  }
  if (!server_) {
    ::close(fd);
    return;
  }
  grpc::AddInsecureChannelFromFd(server_.get(), fd);  // gRPC owns fd from here
}

}  // namespace muster::rendezvous::server_internal
