#include "muster/ops/endpoint.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::ops {

std::string HostPort::to_string() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> parse_host_port(std::string_view text, int default_port, int min_port) {
  auto bad = [](const char* why) { return absl::InvalidArgumentError(why); };
  HostPort hp;
  std::string_view port;
  bool has_port = false;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string_view::npos) return bad("has no closing bracket");
    hp.host = std::string(text.substr(1, close - 1));
    const std::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') return bad("has text after the bracket");
      port = rest.substr(1);
      has_port = true;
    }
  } else {
    const auto colon = text.rfind(':');
    if (colon != std::string_view::npos && text.find(':') != colon) {
      return bad("is an IPv6 address without brackets");
    }
    hp.host = std::string(text.substr(0, colon));
    if (colon != std::string_view::npos) {
      port = text.substr(colon + 1);
      has_port = true;
    }
  }
  if (has_port && port.empty()) return bad("has an empty port");
  if (hp.host.empty()) return bad("has no host");
  hp.port = default_port;
  if (has_port && (!absl::SimpleAtoi(absl::string_view(port.data(), port.size()), &hp.port) ||
                   hp.port < min_port || hp.port > 65535)) {
    return bad("has a bad port");
  }
  return hp;
}

}  // namespace muster::ops
