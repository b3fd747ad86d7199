#include "muster/agent/line_splitter.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>

namespace muster::agent {

void LineSplitter::feed(std::string_view chunk, std::string& out) {
  while (!chunk.empty()) {
    std::size_t nl = chunk.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(chunk);
      while (partial_.size() >= max_line_) {
        out += prefix_;
        out.append(partial_, 0, max_line_);
        out += '\n';
        partial_.erase(0, max_line_);
      }
      return;
    }
    out += prefix_;
    if (!partial_.empty()) {
      out += partial_;
      partial_.clear();
    }
    out.append(chunk.substr(0, nl + 1));
    chunk.remove_prefix(nl + 1);
  }
}

void LineSplitter::finish(std::string& out) {
  if (partial_.empty()) return;
  out += prefix_;
  out += partial_;
  out += '\n';
  partial_.clear();
}

std::string expand_prefix_template(std::string_view t, const std::string& role_name, int rank,
                                   int local_rank) {
  std::string out;
  auto value = [&](std::string_view name, std::string& v) {
    if (name == "role_name")
      v = role_name;
    else if (name == "rank")
      v = std::to_string(rank);
    else if (name == "local_rank")
      v = std::to_string(local_rank);
    else
      return false;
    return true;
  };
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (std::size_t i = 0; i < t.size();) {
    if (t[i] != '$' || i + 1 >= t.size()) {
      out += t[i++];
      continue;
    }
    if (t[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    std::string v;
    if (t[i + 1] == '{') {
      std::size_t close = t.find('}', i + 2);
      if (close != std::string_view::npos && value(t.substr(i + 2, close - i - 2), v)) {
        out += v;
        i = close + 1;
        continue;
      }
    } else {
      std::size_t end = i + 1;
      while (end < t.size() && ident(t[end])) ++end;
      if (value(t.substr(i + 1, end - i - 1), v)) {
        out += v;
        i = end;
        continue;
      }
    }
    out += t[i++];
  }
  return out;
}

void write_all(int fd, std::string_view data) {
  const char* p = data.data();
  std::size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // console gone (EPIPE): nothing left to show it to
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace muster::agent
