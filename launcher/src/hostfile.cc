#include "muster/launcher/hostfile.h"

#include <arpa/inet.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/timeouts.h"

namespace muster::launcher {
namespace {

namespace limits = muster::rendezvous::limits;
using muster::rendezvous::kMaxLocalWorldSize;

// Debian's abseil has its own string_view (not std's): the public API takes std's.
absl::string_view av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool name_char(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

bool all_name_chars(absl::string_view s) {
  for (char c : s) {
    if (!name_char(c)) return false;
  }
  return !s.empty();
}

// A printable form of what was given, for messages: control characters as \xNN.
std::string escaped(absl::string_view s) {
  std::string out;
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(u, absl::kZeroPad2));
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// The canonical text of an IPv6 literal (zone kept), or "" when `s` is not one.
std::string canonical_ipv6(absl::string_view s) {
  absl::string_view addr = s, zone;
  if (auto pct = s.find('%'); pct != absl::string_view::npos) {
    addr = s.substr(0, pct);
    zone = s.substr(pct + 1);
    if (!all_name_chars(zone)) return "";
  }
  std::string a(addr);
  in6_addr bin{};
  if (::inet_pton(AF_INET6, a.c_str(), &bin) != 1) return "";
  char buf[INET6_ADDRSTRLEN];
  if (::inet_ntop(AF_INET6, &bin, buf, sizeof buf) == nullptr) return "";
  return zone.empty() ? std::string(buf) : absl::StrCat(buf, "%", zone);
}

// One host entry split from its slots: `host` without brackets, `slots` as written ("" when
// none).
struct Split {
  std::string host;
  absl::string_view slots;
  bool has_slots = false;
};

// "user@[v6]:N", "[v6]", "v6", "name:N", "name": the host (brackets dropped) and its slots.
absl::StatusOr<Split> split_item(absl::string_view item) {
  Split r;
  absl::string_view user, rest = item;
  if (auto at = item.find('@'); at != absl::string_view::npos) {
    user = item.substr(0, at + 1);  // with the '@'
    rest = item.substr(at + 1);
  }
  if (absl::StartsWith(rest, "[")) {
    auto close = rest.find(']');
    if (close == absl::string_view::npos)
      return absl::InvalidArgumentError(absl::StrCat("'", escaped(item), "': no closing ']'"));
    r.host = absl::StrCat(user, rest.substr(1, close - 1));
    absl::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':')
        return absl::InvalidArgumentError(
            absl::StrCat("'", escaped(item), "': only ':SLOTS' may follow ']'"));
      r.slots = after.substr(1);
      r.has_slots = true;
    }
    if (canonical_ipv6(rest.substr(1, close - 1)).empty())
      return absl::InvalidArgumentError(
          absl::StrCat("'", escaped(item), "': brackets hold an IPv6 address, and '",
                       escaped(rest.substr(1, close - 1)), "' is not one"));
    return r;
  }
  const auto colons = std::count(rest.begin(), rest.end(), ':');
  if (colons == 1) {
    auto c = rest.find(':');
    r.host = absl::StrCat(user, rest.substr(0, c));
    r.slots = rest.substr(c + 1);
    r.has_slots = true;
  } else {
    r.host = std::string(item);  // a name, or a bare IPv6 address (checked below)
  }
  return r;
}

// Why `host` (as stored: "user@" + name or IPv6 address) cannot be one, or OK.
absl::Status check_host(absl::string_view host) {
  if (host.empty()) return absl::InvalidArgumentError("empty host name");
  if (host.size() > limits::kMaxIdBytes)
    return absl::InvalidArgumentError(absl::StrCat(
        "host name of ", host.size(), " bytes is longer than the limit of ", limits::kMaxIdBytes));
  absl::string_view name = host;
  if (auto at = host.find('@'); at != absl::string_view::npos) {
    absl::string_view user = host.substr(0, at);
    name = host.substr(at + 1);
    if (user.empty())
      return absl::InvalidArgumentError(absl::StrCat("'", escaped(host), "': empty user before '@'"));
    if (!all_name_chars(user) || user[0] == '-')
      return absl::InvalidArgumentError(absl::StrCat(
          "'", escaped(host), "': the user name may hold only A-Z a-z 0-9 . _ - (not first)"));
  }
  if (name.empty())
    return absl::InvalidArgumentError(absl::StrCat("'", escaped(host), "': empty host after '@'"));
  if (name.find(':') != absl::string_view::npos) {
    if (canonical_ipv6(name).empty())
      return absl::InvalidArgumentError(
          absl::StrCat("'", escaped(host), "' is neither a host name nor an IPv6 address"));
    return absl::OkStatus();
  }
  if (!all_name_chars(name) || name[0] == '-')
    return absl::InvalidArgumentError(absl::StrCat(
        "'", escaped(host),
        "' is not a host name (only A-Z a-z 0-9 . _ -, not starting with '-'; it goes on an ssh "
        "command line)"));
  return absl::OkStatus();
}

absl::StatusOr<int> parse_slots(absl::string_view v, absl::string_view what) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "'", escaped(v), "' is not in 1..", kMaxLocalWorldSize));
  };
  if (v.empty() || v.size() > 9) return bad();
  for (char c : v) {
    if (!absl::ascii_isdigit(c)) return bad();
  }
  int n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 1 || n > kMaxLocalWorldSize) return bad();
  return n;
}

// What makes two entries the same host: the name without user@, lower case; an IPv6 address
// in its canonical form.
std::string host_key(absl::string_view host) {
  if (auto at = host.find('@'); at != absl::string_view::npos) host = host.substr(at + 1);
  if (host.find(':') != absl::string_view::npos) {
    std::string c = canonical_ipv6(host);
    if (!c.empty()) return c;
  }
  return absl::AsciiStrToLower(host);
}

// Collects hosts, refusing duplicates and more than kMaxHosts. `where` prefixes an error's
// message; `label` says where this entry is ("on line 3"), for a later duplicate's message.
class Collector {
 public:
  absl::Status add(HostSlots h, absl::string_view where, absl::string_view label) {
    std::string key = host_key(h.host);
    if (auto it = seen_.find(key); it != seen_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "host ", escaped(h.host), " is listed twice (first ", it->second, ")"));
    }
    if (hosts_.size() >= limits::kMaxHosts)
      return absl::InvalidArgumentError(
          absl::StrCat(where, "more than ", limits::kMaxHosts, " hosts"));
    seen_.emplace(std::move(key), std::string(label));
    hosts_.push_back(std::move(h));
    return absl::OkStatus();
  }
  std::vector<HostSlots> take() { return std::move(hosts_); }
  bool empty() const { return hosts_.empty(); }

 private:
  std::vector<HostSlots> hosts_;
  std::map<std::string, std::string> seen_;  // key -> where it was first
};

absl::Status with_prefix(absl::string_view prefix, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// HOST or HOST:SLOTS (horovod's item, also a hostfile line's first field); errors behind `where`.
absl::StatusOr<HostSlots> parse_host_item(absl::string_view item, absl::string_view where) {
  auto split = split_item(item);
  if (!split.ok()) return with_prefix(where, split.status());
  if (auto s = check_host(split->host); !s.ok()) return with_prefix(where, s);
  HostSlots h{split->host, 0};
  if (split->has_slots) {
    auto n = parse_slots(split->slots, "slots ");
    if (!n.ok()) return with_prefix(where, n.status());
    h.slots = *n;
  }
  return h;
}

}  // namespace

absl::StatusOr<std::vector<HostSlots>> parse_host_list(std::string_view text_in) {
  const absl::string_view text = av(text_in);
  Collector hosts;
  int index = 0;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    ++index;
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    const std::string where = absl::StrCat("--hosts: item ", index, ": ");
    if (item.empty()) {
      if (absl::StripAsciiWhitespace(text).empty()) break;  // reported as an empty list below
      return absl::InvalidArgumentError(absl::StrCat(where,
                                                     "empty (two ',' in a row, or one at "
                                                     "an end)"));
    }
    auto h = parse_host_item(item, where);
    if (!h.ok()) return h.status();
    if (auto s = hosts.add(std::move(*h), "--hosts: ", absl::StrCat("as item ", index)); !s.ok())
      return s;
  }
  if (hosts.empty()) return absl::InvalidArgumentError("--hosts: no host given");
  return hosts.take();
}

absl::StatusOr<std::vector<HostSlots>> parse_hostfile(std::string_view text_in,
                                                      std::string_view source_in) {
  const absl::string_view text = av(text_in), source = av(source_in);
  Collector hosts;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const std::string where = absl::StrCat(source, ":", line_no, ": ");
    if (auto hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r\v\f"), absl::SkipEmpty());
    if (fields.empty()) continue;
    auto parsed = parse_host_item(fields[0], where);
    if (!parsed.ok()) return parsed.status();
    HostSlots h = std::move(*parsed);
    bool slots_field = false, max_slots_field = false;
    for (std::size_t f = 1; f < fields.size(); ++f) {
      absl::string_view field = fields[f];
      if (absl::ConsumePrefix(&field, "slots=")) {
        if (h.slots > 0 || slots_field)
          return absl::InvalidArgumentError(
              absl::StrCat(where, "slots given twice for ", escaped(h.host)));
        auto n = parse_slots(field, "slots=");
        if (!n.ok()) return with_prefix(where, n.status());
        h.slots = *n;
        slots_field = true;
      } else if (absl::ConsumePrefix(&field, "max_slots=")) {
        // OpenMPI's oversubscription cap: checked as a number, then ignored (launch never
        // runs more than slots workers on a host).
        if (max_slots_field)
          return absl::InvalidArgumentError(
              absl::StrCat(where, "max_slots given twice for ", escaped(h.host)));
        auto n = parse_slots(field, "max_slots=");
        if (!n.ok()) return with_prefix(where, n.status());
        max_slots_field = true;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "'", escaped(fields[f]),
            "' is not understood (after the host: slots=N, max_slots=N, or a '#' comment)"));
      }
    }
    if (auto s = hosts.add(std::move(h), where, absl::StrCat("on line ", line_no)); !s.ok())
      return s;
  }
  if (hosts.empty())
    return absl::InvalidArgumentError(absl::StrCat(source, ": no host in the hostfile"));
  return hosts.take();
}

absl::StatusOr<std::vector<HostSlots>> select_hosts(std::vector<HostSlots> hosts,
                                                    std::string_view include_in,
                                                    std::string_view exclude_in) {
  const absl::string_view include = absl::StripAsciiWhitespace(av(include_in));
  const absl::string_view exclude = absl::StripAsciiWhitespace(av(exclude_in));
  if (!include.empty() && !exclude.empty())
    return absl::InvalidArgumentError("--include and --exclude cannot both be given");
  if (include.empty() && exclude.empty()) return hosts;
  const bool is_include = !include.empty();
  const absl::string_view flag = is_include ? "--include" : "--exclude";
  const absl::string_view text = is_include ? include : exclude;

  // Every way a listed host may be named -> its index: the whole entry and its key.
  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    by_name.emplace(absl::AsciiStrToLower(hosts[i].host), i);
    by_name.emplace(host_key(hosts[i].host), i);
  }
  auto find = [&](absl::string_view name) -> std::optional<std::size_t> {
    std::string n(name);
    if (n.size() >= 2 && n.front() == '[' && n.back() == ']') n = n.substr(1, n.size() - 2);
    if (auto it = by_name.find(absl::AsciiStrToLower(n)); it != by_name.end()) return it->second;
    if (auto it = by_name.find(host_key(n));
        it != by_name.end() && n.find('@') == std::string::npos)
      return it->second;
    return std::nullopt;
  };
  auto per_gpu = [](absl::string_view name) {
    // "host:0" or "host:0,1" split at ',' into "host:0", "1": one ':' (or "]:") and digits
    // after it. A bare IPv6 address (two or more ':') is a name, not this.
    auto c = name.rfind(':');
    if (c == absl::string_view::npos || c + 1 >= name.size()) return false;
    if (name.find(':') != c && (c == 0 || name[c - 1] != ']')) return false;
    for (char ch : name.substr(c + 1)) {
      if (!absl::ascii_isdigit(ch)) return false;
    }
    return true;
  };

  std::set<std::size_t> named;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty())
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": an empty name (two ',' in a row, or one at an end)"));
    if (auto i = find(item)) {  // also a listed "user@host" given whole
      named.insert(*i);
      continue;
    }
    for (absl::string_view part : absl::StrSplit(item, '@')) {
      part = absl::StripAsciiWhitespace(part);
      if (part.empty())
        return absl::InvalidArgumentError(
            absl::StrCat(flag, ": an empty name in '", escaped(item), "'"));
      if (auto i = find(part)) {
        named.insert(*i);
        continue;
      }
      if (per_gpu(part))
        return absl::InvalidArgumentError(absl::StrCat(
            flag, ": '", escaped(part),
            "' selects GPUs of a host (DeepSpeed's host:0,1), which is not supported; name whole "
            "hosts and select GPUs with CUDA_VISIBLE_DEVICES"));
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": host ", escaped(part), " is not in the host list"));
    }
  }
  std::vector<HostSlots> out;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    if ((named.count(i) != 0) == is_include) out.push_back(std::move(hosts[i]));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " leaves no host"));
  return out;
}

}  // namespace muster::launcher
