#include "muster/agent/failure.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <optional>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "muster/ops/text.h"
#include "muster/rendezvous/limits.h"

namespace muster::agent {
namespace {

namespace limits = rendezvous::limits;

std::string format_time(std::int64_t ms) {
  std::time_t t = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

void append_one(std::ostringstream& os, int idx, const v1::WorkerFailure& f) {
  os << "[" << idx << "]:\n";
  os << "  time      : " << format_time(f.timestamp_ms()) << "\n";
  os << "  host      : " << f.host() << "\n";
  os << "  rank      : " << f.rank() << " (local_rank: " << f.local_rank() << ")\n";
  int code = f.signal() > 0 ? -f.signal() : f.exit_code();
  os << "  exitcode  : " << code << " (pid: " << f.pid() << ")\n";
  os << "  error_file: " << (f.message().empty() ? "<N/A>" : f.error_file()) << "\n";
  if (!f.message().empty()) os << "  message   : " << f.message() << "\n";
  os << "  traceback : ";
  if (!f.traceback().empty()) {
    os << f.traceback();
    if (f.traceback().back() != '\n') os << "\n";
  } else if (f.signal() > 0) {
    os << "Signal " << f.signal() << " (" << signal_name(f.signal()) << ") received by PID "
       << f.pid() << "\n";
  } else if (!f.message().empty()) {
    os << f.message() << "\n";
  } else {
    os << "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n";
  }
}

// The string values of torch's @record error file that the summary shows.
struct JsonText {
  std::string text;
  bool cut = false;  // the input ended inside this string
};
struct ErrorFileFields {
  std::optional<JsonText> plain_message;  // {"message": "text"}
  std::optional<JsonText> message;        // {"message": {"message": "text"}}
  std::optional<JsonText> traceback;      // {"message": {"extraInfo": {"py_callstack": ...}}}
};

// A JSON reader for a prefix of a document: it walks the structure, keeps the strings at the
// three paths above, and stops quietly where the input ends (the read bound) or stops being
// JSON. Nesting deeper than the @record format needs is skipped without recursion limits
// mattering: it stops at kMaxDepth.
class PrefixJson {
 public:
  PrefixJson(std::string_view in, ErrorFileFields& out) : in_(in), out_(out) {}
  void parse() { value(kRoot, 0); }

 private:
  enum Path { kOther, kRoot, kMessage, kExtraInfo, kPlainMessage, kInnerMessage, kCallstack };
  static constexpr int kMaxDepth = 64;

  static Path child(Path parent, std::string_view key) {
    if (parent == kRoot && key == "message") return kMessage;
    if (parent == kMessage && key == "message") return kInnerMessage;
    if (parent == kMessage && key == "extraInfo") return kExtraInfo;
    if (parent == kExtraInfo && key == "py_callstack") return kCallstack;
    return kOther;
  }

  void ws() {
    while (pos_ < in_.size() && (in_[pos_] == ' ' || in_[pos_] == '\n' || in_[pos_] == '\t' ||
                                 in_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    ws();
    if (pos_ < in_.size() && in_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  // false: the input ended or is not JSON here; parsing stops.
  bool value(Path path, int depth) {
    ws();
    if (pos_ >= in_.size() || depth > kMaxDepth) return false;
    const char c = in_[pos_];
    if (c == '{') return object(path, depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      JsonText s;
      const bool whole = string(s);
      if (path == kMessage) path = kPlainMessage;
      std::optional<JsonText>* into = path == kPlainMessage   ? &out_.plain_message
                                      : path == kInnerMessage ? &out_.message
                                      : path == kCallstack    ? &out_.traceback
                                                              : nullptr;
      if (into != nullptr) *into = std::move(s);
      return whole;
    }
    const std::size_t start = pos_;
    while (pos_ < in_.size() && (std::isalnum(static_cast<unsigned char>(in_[pos_])) ||
                                 in_[pos_] == '-' || in_[pos_] == '+' || in_[pos_] == '.')) {
      ++pos_;
    }
    return pos_ > start && pos_ < in_.size();
  }

  bool object(Path path, int depth) {
    ++pos_;  // '{'
    if (eat('}')) return true;
    for (;;) {
      ws();
      if (pos_ >= in_.size() || in_[pos_] != '"') return false;
      JsonText key;
      if (!string(key) || !eat(':')) return false;
      if (!value(child(path, key.text), depth + 1)) return false;
      if (eat(',')) continue;
      return eat('}');
    }
  }

  bool array(int depth) {
    ++pos_;  // '['
    if (eat(']')) return true;
    for (;;) {
      if (!value(kOther, depth + 1)) return false;
      if (eat(',')) continue;
      return eat(']');
    }
  }

  static void put_utf8(std::string& s, std::uint32_t cp) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xc0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xe0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      s += static_cast<char>(0xf0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  bool hex4(std::uint32_t& cp) {
    if (pos_ + 4 > in_.size()) return false;
    cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = in_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') {
        cp |= static_cast<std::uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        cp |= static_cast<std::uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        cp |= static_cast<std::uint32_t>(h - 'A' + 10);
      } else {
        return false;
      }
    }
    return true;
  }

  // Decodes the string at pos_ (its opening quote). false when the input ended inside it
  // (s.cut) or an escape is malformed.
  bool string(JsonText& s) {
    ++pos_;  // '"'
    while (pos_ < in_.size()) {
      const char c = in_[pos_++];
      if (c == '"') return true;
      if (c != '\\') {
        s.text += c;
        continue;
      }
      if (pos_ >= in_.size()) break;
      const char e = in_[pos_++];
      switch (e) {
        case 'n': s.text += '\n'; break;
        case 't': s.text += '\t'; break;
        case 'r': s.text += '\r'; break;
        case 'b': s.text += '\b'; break;
        case 'f': s.text += '\f'; break;
        case 'u': {
          std::uint32_t cp = 0;
          if (!hex4(cp)) {
            s.cut = pos_ >= in_.size();
            return false;
          }
          if (cp >= 0xd800 && cp < 0xdc00 && pos_ + 6 <= in_.size() && in_[pos_] == '\\' &&
              in_[pos_ + 1] == 'u') {
            const std::size_t save = pos_;
            pos_ += 2;
            std::uint32_t lo = 0;
            if (hex4(lo) && lo >= 0xdc00 && lo < 0xe000) {
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else {
              pos_ = save;
            }
          }
          put_utf8(s.text, cp >= 0xd800 && cp < 0xe000 ? 0xfffd : cp);
          break;
        }
        default: s.text += e; break;  // \" \\ \/ and anything unknown, as itself
      }
    }
    s.cut = true;
    return false;
  }

  std::string_view in_;
  std::size_t pos_ = 0;
  ErrorFileFields& out_;
};

// Valid UTF-8 with every bad byte (and control characters other than tab and newline, which
// could drive the terminal) replaced by U+FFFD; the server checks ids, not messages, but a
// message is for people to read.
std::string sanitize_utf8(const std::string& in) {
  return ops::printable_utf8(in, std::string_view::npos, /*replace_controls=*/true);
}

// The largest length <= n that does not split a UTF-8 sequence of s.
std::size_t utf8_floor(const std::string& s, std::size_t n) {
  while (n > 0 && n < s.size() && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  return n;
}

// s's beginning within `cap` bytes, the note included. `source_cut`: the read bound ended the
// text, so its full length is unknown (the file's size is given instead).
std::string cut_head(const std::string& s, bool source_cut, std::size_t file_size, std::size_t cap,
                     absl::string_view what) {
  if (!source_cut && s.size() <= cap) return s;
  auto note = [&](std::size_t shown) {
    return source_cut ? absl::StrCat(" [", what, " cut: first ", shown,
                                     " bytes shown; the error file has ", file_size, " bytes]")
                      : absl::StrCat(" [", what, " cut: first ", shown, " of ", s.size(),
                                     " bytes shown]");
  };
  std::size_t shown = std::min(s.size(), cap);
  std::string n = note(shown);
  shown = utf8_floor(s, std::min(s.size(), cap > n.size() ? cap - n.size() : 0));
  return s.substr(0, shown) + note(shown);
}

// s's end within `cap` bytes, after a note on its first line.
std::string cut_tail(const std::string& s, std::size_t cap) {
  if (s.size() <= cap) return s;
  auto note = [&](std::size_t shown) {
    return absl::StrCat("[traceback cut: last ", shown, " of ", s.size(), " bytes shown]\n");
  };
  std::size_t shown = cap - note(cap).size();
  std::size_t from = s.size() - shown;
  while (from < s.size() && (static_cast<unsigned char>(s[from]) & 0xc0) == 0x80) ++from;
  return note(s.size() - from) + s.substr(from);
}

}  // namespace

void read_error_file(const std::string& path, v1::WorkerFailure& f) {
  if (path.empty()) return;
  // A bounded prefix only: a worker may write any amount, the agent's memory stays bounded.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st {};
  const std::size_t file_size = ::fstat(fd, &st) == 0 ? static_cast<std::size_t>(st.st_size) : 0;
  std::string text(std::min(file_size, limits::kMaxErrorFileReadBytes), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  text.resize(got);

  ErrorFileFields fields;
  PrefixJson(text, fields).parse();
  std::optional<JsonText>& msg = fields.message ? fields.message : fields.plain_message;
  if (msg) {
    f.set_message(cut_head(sanitize_utf8(msg->text), msg->cut, file_size,
                           limits::kMaxFailureMessageBytes, "message"));
  }
  if (fields.traceback) {
    std::string tb = sanitize_utf8(fields.traceback->text);
    // A whole traceback keeps its end, where Python names the exception; one the read bound
    // cut off keeps what was read.
    f.set_traceback(fields.traceback->cut
                        ? cut_head(tb, true, file_size, limits::kMaxFailureTracebackBytes,
                                   "traceback")
                        : cut_tail(tb, limits::kMaxFailureTracebackBytes));
  }
  if (f.message().empty() && !f.traceback().empty()) f.set_message("(see traceback)");
}

namespace {

// torch's @record error file: {"message": {"message", "extraInfo": {"py_callstack",
// "timestamp"}, "errorCode" (when given)}}.
std::string record_json(const std::string& message, const std::string& callstack,
                        std::int64_t timestamp_s, std::optional<int> error_code) {
  google::protobuf::Struct root;
  auto& fields = *(*root.mutable_fields())["message"].mutable_struct_value()->mutable_fields();
  fields["message"].set_string_value(message);
  auto& extra = *fields["extraInfo"].mutable_struct_value()->mutable_fields();
  extra["py_callstack"].set_string_value(callstack);
  extra["timestamp"].set_string_value(std::to_string(timestamp_s));
  if (error_code) fields["errorCode"].set_number_value(*error_code);
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(root, &out).ok()) return "{}";
  return out;
}

}  // namespace

std::string error_file_json(const v1::WorkerFailure& f) {
  const int code = f.signal() > 0 ? -f.signal() : f.exit_code();
  std::string text = f.message();
  if (text.empty()) {
    text = f.signal() > 0 ? "Signal " + std::to_string(f.signal()) + " (" + signal_name(f.signal()) +
                                ") received by PID " + std::to_string(f.pid())
                          : "worker exited with code " + std::to_string(code);
  }
  return record_json(text, f.traceback(), f.timestamp_ms() / 1000, code);
}

std::string signal_exception_json(int sig, long pid, std::int64_t timestamp_s) {
  const std::string text =
      absl::StrCat("SignalException: Process ", pid, " got signal: ", sig);
  return record_json(text,
                     absl::StrCat("torch.distributed.elastic.multiprocessing.api.", text,
                                  " (launch received ", signal_name(sig),
                                  ", stopped its workers and exited ", 128 + sig, ")\n"),
                     timestamp_s, std::nullopt);
}

void write_signal_exception(const std::string& path, int sig) {
  std::ofstream(path) << signal_exception_json(sig, ::getpid(),
                                               static_cast<std::int64_t>(std::time(nullptr)));
}

std::string module_not_found_hint(std::string_view text, int rank, std::string_view interpreter) {
  constexpr std::string_view kError = "ModuleNotFoundError";
  // The last one: a traceback ends with the exception that ended the program.
  const std::size_t at = text.rfind(kError);
  if (at == std::string_view::npos) return "";
  std::string_view line = text.substr(at);
  line = line.substr(0, std::min({line.find('\n'), line.find('\r'), std::size_t{300}}));
  std::ostringstream os;
  os << "launch: worker rank " << rank << " failed with " << sanitize_utf8(std::string(line))
     << "\n  it ran under " << interpreter
     << ";\n  to run workers under the python that has the module, set PYTHON_EXEC "
        "(e.g. PYTHON_EXEC=/path/to/venv/bin/python) or activate its virtual environment\n";
  return os.str();
}

std::string signal_name(int sig) {
  if (const char* abbrev = sigabbrev_np(sig); abbrev != nullptr) {
    return std::string("SIG") + abbrev;
  }
  return "signal " + std::to_string(sig);
}

std::string format_failure_summary(std::string_view entrypoint, const v1::WorkerFailure& root,
                                   const std::vector<v1::WorkerFailure>& others) {
  const std::string eq(60, '='), dash(60, '-');
  std::ostringstream os;
  os << eq << "\n" << entrypoint << " FAILED\n" << dash << "\nFailures:\n";
  if (others.empty()) {
    os << "  <NO_OTHER_FAILURES>\n";
  } else {
    int idx = 1;
    for (const auto& f : others) append_one(os, idx++, f);
  }
  os << dash << "\nRoot Cause (first observed failure):\n";
  append_one(os, 0, root);
  os << eq << "\n";
  return os.str();
}

}  // namespace muster::agent
