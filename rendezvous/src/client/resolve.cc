#include "muster/rendezvous/resolve.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"

namespace muster::rendezvous {
namespace {

// Runs `f` on a thread of its own and waits for it at most `timeout`. A lookup cannot be
// cancelled: one that overruns is detached and finishes (into state nobody reads) by itself.
template <typename T, typename F>
std::optional<T> bounded(F f, std::chrono::milliseconds timeout) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<T> result;
  };
  auto state = std::make_shared<State>();
  std::thread([state, f = std::move(f)]() mutable {
    T r = f();
    std::lock_guard<std::mutex> lock(state->mu);
    state->result = std::move(r);
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait_for(lock, timeout, [&] { return state->result.has_value(); });
  return state->result;
}

std::string numeric(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST] = {};
  if (::getnameinfo(sa, len, buf, sizeof buf, nullptr, 0, NI_NUMERICHOST) != 0) return {};
  return buf;
}

struct Lookup {
  int rc = 0;
  std::vector<std::string> addresses;
};

Lookup lookup(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  Lookup out;
  out.rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (out.rc != 0) return out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    std::string s = numeric(a->ai_addr, a->ai_addrlen);
    if (!s.empty() && std::find(out.addresses.begin(), out.addresses.end(), s) == out.addresses.end()) {
      out.addresses.push_back(std::move(s));
    }
  }
  ::freeaddrinfo(res);
  return out;
}

std::string seconds_text(std::chrono::milliseconds d) {
  return absl::StrCat(static_cast<double>(d.count()) / 1000);
}

}  // namespace

bool is_ip_literal(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, host.c_str(), buf) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

absl::StatusOr<std::vector<std::string>> resolve_host(const std::string& host,
                                                      std::chrono::milliseconds timeout) {
  if (is_ip_literal(host)) return std::vector<std::string>{host};
  std::optional<Lookup> r = bounded<Lookup>([host] { return lookup(host); }, timeout);
  if (!r) {
    return absl::DeadlineExceededError(absl::StrCat(
        "cannot resolve '", host, "': the system resolver did not answer within ",
        seconds_text(timeout), " s (is the DNS server in /etc/resolv.conf reachable? a name "
        "in /etc/hosts needs none)"));
  }
  if (r->rc != 0 || r->addresses.empty()) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': ",
                                            r->rc != 0 ? ::gai_strerror(r->rc) : "no address"));
  }
  return r->addresses;
}

std::string grpc_address_target(const std::string& address, int port) {
  if (address.find(':') != std::string::npos) return absl::StrCat("ipv6:[", address, "]:", port);
  return absl::StrCat("ipv4:", address, ":", port);
}

std::string fully_qualified_hostname(std::chrono::milliseconds timeout) {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  const std::string host = name;
  std::optional<std::string> fq = bounded<std::string>(
      [host] {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_flags = AI_CANONNAME;
        addrinfo* res = nullptr;
        std::string out = host;
        if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0 && res != nullptr) {
          char buf[NI_MAXHOST];
          if (::getnameinfo(res->ai_addr, res->ai_addrlen, buf, sizeof buf, nullptr, 0,
                            NI_NAMEREQD) == 0) {
            out = buf;
          } else if (res->ai_canonname != nullptr) {
            out = res->ai_canonname;
          }
          ::freeaddrinfo(res);
        }
        return out;
      },
      timeout);
  return fq ? *fq : host;
}

bool is_local_address(const std::vector<std::string>& addresses) {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool local = false;
  for (ifaddrs* i = ifs; i != nullptr && !local; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    const std::string mine = numeric(i->ifa_addr, len);
    for (const std::string& a : addresses) {
      // getnameinfo writes a link-local v6 address with its zone ("fe80::1%eth0").
      if (a == mine || (mine.rfind(a + "%", 0) == 0)) local = true;
    }
  }
  ::freeifaddrs(ifs);
  return local;
}

std::string host_of(const std::string& host_port) {
  if (!host_port.empty() && host_port.front() == '[') {
    const auto end = host_port.find(']');
    return host_port.substr(1, end == std::string::npos ? std::string::npos : end - 1);
  }
  const auto colon = host_port.rfind(':');
  // One colon: HOST:PORT. More, without brackets: an IPv6 address with no port.
  if (colon == std::string::npos || host_port.find(':') != colon) return host_port;
  return host_port.substr(0, colon);
}

}  // namespace muster::rendezvous
