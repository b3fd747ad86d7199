#include "muster/ops/control_channel.h"

#include "absl/strings/numbers.h"

namespace muster::ops::control {
namespace {

bool printable_word(std::string_view s, bool allow_eq) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c <= ' ' || c > '~') return false;
    if (!allow_eq && c == '=') return false;
  }
  return true;
}

}  // namespace

std::optional<long long> Message::number(const std::string& key) const {
  auto it = fields.find(key);
  long long v = 0;
  if (it == fields.end() || !absl::SimpleAtoi(it->second, &v)) return std::nullopt;
  return v;
}

std::string Message::text(const std::string& key) const {
  auto it = fields.find(key);
  return it == fields.end() ? std::string() : it->second;
}

std::string encode(const Message& m) {
  std::string out = m.kind;
  for (const auto& [k, v] : m.fields) {
    if (!printable_word(k, false) || !printable_word(v, true)) continue;
    out += ' ';
    out += k;
    out += '=';
    out += v;
  }
  return out;
}

std::optional<Message> parse(std::string_view bytes) {
  if (bytes.empty() || bytes.size() > kMaxMessageBytes) return std::nullopt;
  Message m;
  std::size_t at = 0;
  bool first = true;
  while (at < bytes.size()) {
    std::size_t sp = bytes.find(' ', at);
    if (sp == std::string_view::npos) sp = bytes.size();
    const std::string_view word = bytes.substr(at, sp - at);
    at = sp + 1;
    if (first) {
      if (!printable_word(word, false)) return std::nullopt;
      m.kind = std::string(word);
      first = false;
      continue;
    }
    const std::size_t eq = word.find('=');
    if (eq == std::string_view::npos || eq == 0 || eq + 1 == word.size()) return std::nullopt;
    const std::string_view key = word.substr(0, eq), value = word.substr(eq + 1);
    if (!printable_word(key, false) || !printable_word(value, true)) return std::nullopt;
    m.fields[std::string(key)] = std::string(value);
  }
  if (m.kind.empty()) return std::nullopt;
  return m;
}

}  // namespace muster::ops::control
