// ops/json.h: JSON strings and objects as the event logs and status write them.
#include "muster/ops/json.h"

#include <catch2/catch.hpp>
#include <limits>

using muster::ops::json_string;
using muster::ops::JsonObject;

TEST_CASE("json: strings are escaped and kept UTF-8", "[json]") {
  CHECK(json_string("plain") == "\"plain\"");
  CHECK(json_string("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(json_string("l1\nl2\t\r") == "\"l1\\nl2\\t\\r\"");
  CHECK(json_string(std::string("\x01\x1f\x7f", 3)) == "\"\\u0001\\u001f\\u007f\"");
  CHECK(json_string(std::string("nul\0x", 5)) == "\"nul\\u0000x\"");
  CHECK(json_string("h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80") == "\"h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\"");
  // Not UTF-8: a lone continuation byte, a cut sequence, an overlong '/', a surrogate.
  CHECK(json_string("a\x80z") == "\"a\xEF\xBF\xBDz\"");
  CHECK(json_string("\xE2\x82") == "\"\xEF\xBF\xBD\xEF\xBF\xBD\"");
  CHECK(json_string("\xC0\xAF") == "\"\xEF\xBF\xBD\xEF\xBF\xBD\"");
  CHECK(json_string("\xED\xA0\x80") == "\"\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\"");
}

TEST_CASE("json: objects field by field", "[json]") {
  CHECK(JsonObject().str() == "{}");
  JsonObject o;
  o.add("s", "v").add("n", -3).add("big", 1LL << 40).add("t", true).add("x", 0.5);
  o.add_raw("o", JsonObject().add("k", "w").str());
  CHECK(o.str() == "{\"s\":\"v\",\"n\":-3,\"big\":1099511627776,\"t\":true,\"x\":0.5,\"o\":{\"k\":\"w\"}}");
  CHECK(JsonObject().add("nan", std::numeric_limits<double>::quiet_NaN()).str() == "{\"nan\":null}");
}
