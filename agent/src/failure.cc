#include "muster/agent/failure.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

namespace muster::agent {
namespace {

const google::protobuf::Value* field(const google::protobuf::Struct& s, const char* name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

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

}  // namespace

void read_error_file(const std::string& path, v1::WorkerFailure& f) {
  if (path.empty()) return;
  std::ifstream in(path);
  if (!in) return;
  std::stringstream ss;
  ss << in.rdbuf();
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(ss.str(), &root).ok()) return;
  const google::protobuf::Value* msg = field(root, "message");
  if (msg == nullptr) return;
  if (msg->has_string_value()) {
    f.set_message(msg->string_value());
    return;
  }
  if (!msg->has_struct_value()) return;
  const google::protobuf::Struct& m = msg->struct_value();
  if (const auto* text = field(m, "message"); text != nullptr && text->has_string_value()) {
    f.set_message(text->string_value());
  }
  if (const auto* extra = field(m, "extraInfo"); extra != nullptr && extra->has_struct_value()) {
    if (const auto* cs = field(extra->struct_value(), "py_callstack");
        cs != nullptr && cs->has_string_value()) {
      f.set_traceback(cs->string_value());
    }
  }
  if (f.message().empty() && !f.traceback().empty()) f.set_message("(see traceback)");
}

std::string error_file_json(const v1::WorkerFailure& f) {
  google::protobuf::Struct root;
  google::protobuf::Struct* msg = (*root.mutable_fields())["message"].mutable_struct_value();
  auto& fields = *msg->mutable_fields();
  const int code = f.signal() > 0 ? -f.signal() : f.exit_code();
  std::string text = f.message();
  if (text.empty()) {
    text = f.signal() > 0 ? "Signal " + std::to_string(f.signal()) + " (" + signal_name(f.signal()) +
                                ") received by PID " + std::to_string(f.pid())
                          : "worker exited with code " + std::to_string(code);
  }
  fields["message"].set_string_value(text);
  auto& extra = *fields["extraInfo"].mutable_struct_value()->mutable_fields();
  extra["py_callstack"].set_string_value(f.traceback());
  extra["timestamp"].set_string_value(std::to_string(f.timestamp_ms() / 1000));
  fields["errorCode"].set_number_value(code);
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(root, &out).ok()) return "{}";
  return out;
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
