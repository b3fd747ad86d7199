// A JSON object written field by field (RFC 8259 strings: quotes, backslashes and control
// characters escaped; bytes that are not UTF-8 replaced with U+FFFD), for the event logs, the
// status JSON and the live page.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace muster::ops {

// `s` as a JSON string literal, quotes included.
std::string json_string(std::string_view s);

// Items that are already JSON (objects built with JsonObject, ...) as one array: "[a,b]".
std::string json_array(const std::vector<std::string>& items);

class JsonObject {
 public:
  JsonObject& add(std::string_view key, std::string_view value);
  JsonObject& add(std::string_view key, const char* value) { return add(key, std::string_view(value)); }
  JsonObject& add(std::string_view key, const std::string& value) { return add(key, std::string_view(value)); }
  JsonObject& add(std::string_view key, long long value);
  JsonObject& add(std::string_view key, int value) { return add(key, static_cast<long long>(value)); }
  JsonObject& add(std::string_view key, long value) { return add(key, static_cast<long long>(value)); }
  JsonObject& add(std::string_view key, bool value);
  JsonObject& add(std::string_view key, double value);
  // `json` is already JSON (an object or array built elsewhere).
  JsonObject& add_raw(std::string_view key, std::string_view json);
  std::string str() const { return body_ + "}"; }

 private:
  void key(std::string_view k);
  std::string body_ = "{";
};

}  // namespace muster::ops
