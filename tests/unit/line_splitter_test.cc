#include "muster/agent/line_splitter.h"

#include <catch2/catch.hpp>

using muster::agent::expand_prefix_template;
using muster::agent::LineSplitter;

TEST_CASE("lines: whole lines are prefixed, partial ones held", "[lines]") {
  LineSplitter s("[default1]:");
  std::string out;
  s.feed("hello\nwor", out);
  CHECK(out == "[default1]:hello\n");
  out.clear();
  s.feed("ld", out);
  CHECK(out.empty());
  s.feed("\n\nx", out);
  CHECK(out == "[default1]:world\n[default1]:\n");
  out.clear();
  s.finish(out);
  CHECK(out == "[default1]:x\n");
  out.clear();
  s.finish(out);
  CHECK(out.empty());
}

TEST_CASE("lines: a line split over many reads arrives once and whole", "[lines]") {
  LineSplitter s("P:");
  std::string out;
  const std::string line = std::string(10000, 'a') + "\n";
  for (char c : line) s.feed(std::string_view(&c, 1), out);
  CHECK(out == "P:" + line);
}

TEST_CASE("lines: an endless line is cut at the limit, each piece prefixed", "[lines]") {
  LineSplitter s("P:", 4);
  std::string out;
  s.feed("abcdefghij", out);
  CHECK(out == "P:abcd\nP:efgh\n");
  out.clear();
  s.finish(out);
  CHECK(out == "P:ij\n");
}

TEST_CASE("lines: prefix template as torchrun expands it", "[lines]") {
  CHECK(expand_prefix_template("[${role_name}${rank}]:", "default", 3, 1) == "[default3]:");
  CHECK(expand_prefix_template("$rank|${local_rank}|$role_name ", "w", 5, 2) == "5|2|w ");
  CHECK(expand_prefix_template("$$ ${unknown} $x ${rank", "w", 5, 2) == "$ ${unknown} $x ${rank");
}
