#include "muster/agent/file_timer.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/system_timer.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace muster::agent {
namespace {

// A reader for one flat JSON object (string, number, true/false/null values): all the
// protocol has. Anything else is an error; nothing is read past the line.
class FlatJson {
 public:
  explicit FlatJson(std::string_view s) : s_(s) {}

  struct Value {
    enum Kind { kString, kNumber, kOther } kind = kOther;
    std::string text;  // kString: decoded; kNumber: the token
  };

  absl::StatusOr<std::map<std::string, Value>> parse() {
    std::map<std::string, Value> out;
    ws();
    if (!eat('{')) return bad("expected '{'");
    ws();
    if (eat('}')) return finish(std::move(out));
    for (;;) {
      ws();
      std::string key;
      if (!string(key)) return bad("expected a string key");
      ws();
      if (!eat(':')) return bad("expected ':'");
      ws();
      Value v;
      if (peek() == '"') {
        v.kind = Value::kString;
        if (!string(v.text)) return bad("bad string");
      } else if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
        v.kind = Value::kNumber;
        while (i_ < s_.size() && std::strchr("+-.eE0123456789", s_[i_]) != nullptr) {
          v.text += s_[i_++];
        }
      } else if (word("true") || word("false") || word("null")) {
        v.kind = Value::kOther;
      } else {
        return bad("unexpected value");
      }
      out[key] = std::move(v);
      ws();
      if (eat(',')) continue;
      if (eat('}')) return finish(std::move(out));
      return bad("expected ',' or '}'");
    }
  }

 private:
  absl::StatusOr<std::map<std::string, Value>> finish(std::map<std::string, Value> out) {
    ws();
    if (i_ != s_.size()) return bad("text after the object");
    return out;
  }
  absl::Status bad(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("timer request: ", absl::string_view(what.data(), what.size()), " at byte ", i_));
  }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++i_;
    return true;
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  static void put_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  bool string(std::string& out) {
    if (!eat('"')) return false;
    while (i_ < s_.size()) {
      char c = s_[i_++];
      if (c == '"') return true;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) return false;
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) return false;
          unsigned cp = 0;
          for (int k = 0; k < 4; ++k) {
            char h = s_[i_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= static_cast<unsigned>(h - 'A' + 10);
            else return false;
          }
          put_utf8(out, cp);  // a surrogate half stays as it is: only compared, never shown
          break;
        }
        default: return false;
      }
    }
    return false;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

bool to_number(const std::string& token, double& out) {
  if (token.empty()) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(token.c_str(), &end);
  return end == token.c_str() + token.size() && errno == 0 && std::isfinite(out);
}

WallTime wall_from_seconds(double s) {
  // Saturating: a timer past what the clock holds never expires.
  const double max_s = static_cast<double>(
      std::chrono::duration_cast<std::chrono::seconds>(WallTime::max().time_since_epoch()).count());
  if (s >= max_s) return WallTime::max();
  return WallTime(std::chrono::duration_cast<WallTime::duration>(std::chrono::duration<double>(s)));
}

}  // namespace

absl::StatusOr<TimerRequest> parse_timer_request(std::string_view line) {
  if (line.size() > kMaxTimerRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("timer request of ", line.size(),
                                                   " bytes is above the limit of ",
                                                   kMaxTimerRequestBytes));
  }
  auto obj = FlatJson(line).parse();
  if (!obj.ok()) return obj.status();
  auto num = [&](const char* key, bool required, double& out) -> absl::Status {
    auto it = obj->find(key);
    if (it == obj->end()) {
      return required ? absl::InvalidArgumentError(absl::StrCat("timer request: no '", key, "'"))
                      : absl::OkStatus();
    }
    if (it->second.kind != FlatJson::Value::kNumber || !to_number(it->second.text, out)) {
      return absl::InvalidArgumentError(absl::StrCat("timer request: '", key, "' is not a number"));
    }
    return absl::OkStatus();
  };
  TimerRequest r;
  double pid = 0, sig = 0;
  if (auto st = num("pid", true, pid); !st.ok()) return st;
  if (auto st = num("expiration_time", true, r.expiration_time); !st.ok()) return st;
  if (auto st = num("signal", false, sig); !st.ok()) return st;
  if (pid < 1 || pid > 4194304 || pid != std::floor(pid)) {
    return absl::InvalidArgumentError("timer request: 'pid' is not a process id");
  }
  if (sig < 0 || sig > 64 || sig != std::floor(sig)) {
    return absl::InvalidArgumentError("timer request: 'signal' is not a signal number");
  }
  auto scope = obj->find("scope_id");
  if (scope == obj->end() || scope->second.kind != FlatJson::Value::kString) {
    return absl::InvalidArgumentError("timer request: no string 'scope_id'");
  }
  r.pid = static_cast<pid_t>(pid);
  r.signal = static_cast<int>(sig);
  r.scope_id = scope->second.text;
  return r;
}

bool FileTimerTable::apply(const TimerRequest& r) {
  auto key = std::make_pair(r.pid, r.scope_id);
  if (r.expiration_time < 0) {
    timers_.erase(key);
    return true;
  }
  if (timers_.size() >= kMaxFileTimers && timers_.count(key) == 0) return false;
  timers_[key] = Timer{wall_from_seconds(r.expiration_time), r.signal};
  return true;
}

std::vector<FileTimerTable::Expired> FileTimerTable::take_expired(WallTime now) {
  std::map<pid_t, std::vector<std::pair<WallTime, std::pair<std::string, int>>>> by_pid;
  for (const auto& [key, t] : timers_) {
    if (t.at <= now) by_pid[key.first].push_back({t.at, {key.second, t.signal}});
  }
  std::vector<Expired> out;
  for (auto& [pid, list] : by_pid) {
    std::sort(list.begin(), list.end());
    Expired e;
    e.pid = pid;
    e.signal = list.front().second.second;
    for (const auto& item : list) e.scopes.push_back(item.second.first);
    out.push_back(std::move(e));
    clear(pid);
  }
  return out;
}

void FileTimerTable::clear(pid_t pid) {
  for (auto it = timers_.lower_bound({pid, std::string()});
       it != timers_.end() && it->first.first == pid;) {
    it = timers_.erase(it);
  }
}

std::optional<WallTime> FileTimerTable::next_expiry() const {
  std::optional<WallTime> best;
  for (const auto& [key, t] : timers_) {
    if (!best || t.at < *best) best = t.at;
  }
  return best;
}

class FileTimerServer::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(boost::asio::io_context& io, std::string path, OnExpired cb)
      : io(io), path(std::move(path)), on_expired(std::move(cb)), reader(io), timer(io) {}

  boost::asio::io_context& io;
  std::string path;
  OnExpired on_expired;
  boost::asio::posix::stream_descriptor reader;
  int keep_open = -1;  // our own write end: the FIFO never reads EOF when clients close
  boost::asio::system_timer timer;
  FileTimerTable table;
  std::array<char, 8192> buf{};
  std::string line;
  bool discarding = false;  // inside a line longer than the bound
  bool stopped = false;

  void read() {
    reader.async_read_some(boost::asio::buffer(buf), [self = shared_from_this()](
                                                         const boost::system::error_code& ec,
                                                         std::size_t n) {
      if (ec || self->stopped) return;
      self->feed(std::string_view(self->buf.data(), n));
      self->read();
    });
  }

  void feed(std::string_view data) {
    for (char c : data) {
      if (c != '\n') {
        if (discarding) continue;
        if (line.size() >= kMaxTimerRequestBytes) {
          spdlog::warn("file timer: a request longer than {} bytes was dropped",
                       kMaxTimerRequestBytes);
          discarding = true;
          line.clear();
          continue;
        }
        line += c;
        continue;
      }
      if (!discarding && !line.empty()) handle(line);
      discarding = false;
      line.clear();
    }
    arm();
  }

  void handle(const std::string& text) {
    auto r = parse_timer_request(text);
    if (!r.ok()) {
      spdlog::warn("file timer: {}", std::string(r.status().message()));
      return;
    }
    if (!table.apply(*r)) {
      spdlog::warn("file timer: {} timers held, the limit; request of pid {} dropped",
                   kMaxFileTimers, r->pid);
    }
  }

  void arm() {
    auto next = table.next_expiry();
    if (!next) {
      timer.cancel();
      return;
    }
    timer.expires_at(*next);
    timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped) return;
      for (const auto& e : self->table.take_expired(std::chrono::system_clock::now())) {
        self->on_expired(e);
      }
      self->arm();
    });
  }
};

absl::StatusOr<std::unique_ptr<FileTimerServer>> FileTimerServer::start(
    boost::asio::io_context& io, const std::string& path, OnExpired on_expired) {
  if (::mkfifo(path.c_str(), 0600) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("file timer: cannot make the FIFO ", path, ": ", std::strerror(errno)));
  }
  int rd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  int wr = rd >= 0 ? ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC) : -1;
  if (rd < 0 || wr < 0) {
    const int e = errno;
    if (rd >= 0) ::close(rd);
    ::unlink(path.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("file timer: cannot open the FIFO ", path, ": ", std::strerror(e)));
  }
  auto impl = std::make_shared<Impl>(io, path, std::move(on_expired));
  impl->reader.assign(rd);
  impl->keep_open = wr;
  impl->read();
  return std::unique_ptr<FileTimerServer>(new FileTimerServer(std::move(impl)));
}

FileTimerServer::FileTimerServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

FileTimerServer::~FileTimerServer() {
  impl_->stopped = true;
  boost::system::error_code ignored;
  impl_->reader.close(ignored);
  impl_->timer.cancel();
  if (impl_->keep_open >= 0) ::close(impl_->keep_open);
  ::unlink(impl_->path.c_str());
}

const std::string& FileTimerServer::path() const { return impl_->path; }

void FileTimerServer::clear(pid_t pid) {
  impl_->table.clear(pid);
  impl_->arm();
}

}  // namespace muster::agent
