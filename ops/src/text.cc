#include "muster/ops/text.h"

#include <cstdint>

namespace muster::ops {

std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  std::size_t len;
  std::uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;  // a continuation byte, C0/C1 (always overlong), or F5..FF
  }
  if (s.size() - i < len) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const auto cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (cc & 0x3F);
  }
  if (len == 3 && cp < 0x800) return 0;                       // overlong
  if (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;  // overlong, or too large
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;                 // a surrogate
  return len;
}

bool is_valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t len = utf8_sequence_length(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string printable_utf8(std::string_view s, std::size_t max, bool replace_controls) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(std::min(s.size(), max));
  std::size_t i = 0;
  while (i < s.size() && i < max) {
    const std::size_t len = utf8_sequence_length(s, i);
    const auto c = static_cast<unsigned char>(s[i]);
    const bool control = len == 1 && (c == 0x7F || (c < 0x20 && c != '\n' && c != '\t'));
    if (len == 0 || (replace_controls && control)) {
      out += kReplacement;
      ++i;
    } else {
      out.append(s.substr(i, len));
      i += len;
    }
  }
  if (i < s.size()) out += "...";
  return out;
}

bool token_matches(std::string_view given, std::string_view expected) {
  if (expected.empty()) return true;
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (std::size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ expected[i % expected.size()]);
  }
  return diff == 0;
}

}  // namespace muster::ops
