// rdzvd's live page (--http_port) in a real headless Chromium, driven over the DevTools
// protocol by live_page_driver.py (Python 3, stdlib). Exits 77 (ctest: Skipped) where
// /usr/bin/chromium or /usr/bin/python3 is missing (scripts/setup installs chromium).
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"
#include "rdzvd_proc.h"

using namespace muster::testing;

namespace {

const std::string kChromium = "/usr/bin/chromium";

// The line "<step>: <value>" the driver printed, or "" when it did not.
std::string step(const std::string& out, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("(^|\n)" + name + ": ([^\n]*)"))) return "";
  return m[2].str();
}

// A JS expression for the driver: null until run `job` shows round `round`, running, and
// `ok` (JS over `rows`, its node rows) holds; then one line: "round R | STATE NODE GROUP
// RANKS HOST | ..." from the cells' visible text, and the events list's texts.
std::string until(int round, const std::string& ok) {
  return R"JS((() => {
    const run = document.querySelector('section.run[data-run="job"]');
    if (!run || run.dataset.phase !== 'running' || run.dataset.round !== ')JS" +
         std::to_string(round) + R"JS(') return null;
    const rows = [...run.querySelectorAll('tr.node')];
    const events = [...document.querySelectorAll('#events li')].map((li) => li.innerText);
    if (!()JS" + ok + R"JS()) return null;
    const cell = (r, i) => r.cells[i].innerText.replace('\u2013', '-');
    return 'round ' + run.querySelector('dd.round').innerText + ' | ' +
        rows.map((r) => [0, 4, 1, 2, 3].map((i) => cell(r, i)).join(' ')).join(' | ') +
        ' | events ' + events.map((t) => t.split(' ')[1]).join(',');
  })())JS";
}

}  // namespace

TEST_CASE("live page: a browser shows a two-agent run, then the lost node and the new round "
          "after kill -9 of one agent, without a reload",
          "[live_page]") {
  RdzvdProc server({"--http_port", "0"});
  REQUIRE(server.page_port > 0);
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=0.5"};
  Proc a(launch_args(agent_flags(server.endpoint, "1:2", 2, "job", conf), {"wait"}));
  Proc b(launch_args(agent_flags(server.endpoint, "1:2", 2, "job", conf), {"wait"}));
  REQUIRE(a.wait_output(has_ready(2, "world 4 round 1"), 30s));
  REQUIRE(b.wait_output(has_ready(2, "world 4 round 1"), 30s));
  const std::string node_a = "127.0.0.1:" + std::to_string(a.pid());
  const std::string node_b = "127.0.0.1:" + std::to_string(b.pid());
  auto state_of = [](const std::string& node, const std::string& state) {
    return "rows.some((r) => r.dataset.node === '" + node + "' && r.dataset.state === '" + state +
           "')";
  };

  TempDir dir;
  const std::string shot = dir.file("live_page.png");
  // The driver kill -9's agent b (by its pid) once the first view is captured; this test
  // reaps it below.
  Proc driver({kPython, LIVE_PAGE_DRIVER, "--chromium", kChromium, "--profile", dir.file("profile"),
               "--url", "http://127.0.0.1:" + std::to_string(server.page_port) + "/",
               "--screenshot", shot, "--kill", std::to_string(b.pid()), "--timeout", "30",
               "--until-1",
               until(1, "rows.length === 2 && " + state_of(node_a, "member") + " && " +
                            state_of(node_b, "member")),
               "--until-2",
               until(2, state_of(node_a, "member") + " && " + state_of(node_b, "lost") +
                            " && events.some((t) => t.includes('node_lost') && t.includes('" +
                            node_b + "'))")});
  const auto code = driver.wait(180s);
  const std::string& out = driver.out();
  INFO(out << driver.err());
  REQUIRE(code == 0);
  CHECK(b.wait(30s) == 128 + SIGKILL);

  // First view: both agents, members, with their group ranks, ranks and host.
  const std::string first = step(out, "shown");
  CHECK_THAT(first, Catch::StartsWith("round 1 | "));
  const std::regex row_a("member " + node_a + " ([01]) (0-1|2-3) 127\\.0\\.0\\.1");
  const std::regex row_b("member " + node_b + " ([01]) (0-1|2-3) 127\\.0\\.0\\.1");
  std::smatch ma, mb;
  REQUIRE(std::regex_search(first, ma, row_a));
  REQUIRE(std::regex_search(first, mb, row_b));
  CHECK(ma[1].str() != mb[1].str());
  CHECK(ma[2].str() == (ma[1].str() == "0" ? "0-1" : "2-3"));
  CHECK_THAT(first, Catch::Contains("events round_formed,node_joined,node_joined"));

  // The screenshot decoded (the driver inflated its image data) to a real page's size.
  std::smatch size;
  const std::string shot_line = step(out, "screenshot");
  REQUIRE(std::regex_match(shot_line, size, std::regex(R"((\d+)x(\d+) (\d+) bytes (\d+) distinct)")));
  CHECK(std::stoi(size[1]) >= 800);
  CHECK(std::stoi(size[2]) >= 600);
  CHECK(std::stoi(size[3]) > 10000);
  CHECK(std::stoi(size[4]) > 8);  // not one flat colour
  const std::string png = read_file(shot);
  CHECK(png.size() == std::stoul(size[3]));
  CHECK(png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);
  std::error_code ec;
  std::filesystem::copy_file(shot, LIVE_PAGE_SCREENSHOT,
                             std::filesystem::copy_options::overwrite_existing, ec);
  CHECK_FALSE(ec);  // a copy for humans: build/live_page.png

  // After the kill: the same document shows round 2, a still a member, b lost.
  const std::string then = step(out, "then");
  CHECK_THAT(then, Catch::StartsWith("round 2 | "));
  CHECK(std::regex_search(then, std::regex("member " + node_a + " 0 0-1 127\\.0\\.0\\.1")));
  CHECK(std::regex_search(then, std::regex("lost " + node_b + " - - 127\\.0\\.0\\.1")));
  CHECK_THAT(then, Catch::Contains("events round_formed,restart,node_lost,"));
  CHECK(step(out, "document") == "no reload");
  CHECK(step(out, "chromium ended") != "");
  CHECK(a.wait_output(has_ready(2, "world 2 round 2"), 30s));
  ::kill(a.pid(), SIGTERM);
  CHECK(a.wait(30s) == 128 + SIGTERM);
}

TEST_CASE("live page: an in-place recovery shows with its phases, the survivor's worker kept",
          "[live_page][in_place]") {
  RdzvdProc server({"--http_port", "0"});
  REQUIRE(server.page_port > 0);
  auto agent = [&] {
    std::vector<std::string> argv{kLaunch};
    for (const std::string& f :
         agent_flags(server.endpoint, "1:2", 1, "job",
                     {"--in_place", "--max_restarts=1", "--rdzv_conf=last_call_timeout=60"})) {
      argv.push_back(f);
    }
    argv.insert(argv.end(), {TRAIN_BIN, "--steps", "100000", "--log-every", "1000"});
    return std::make_unique<Proc>(argv);
  };
  auto a = agent(), b = agent();
  REQUIRE(a->wait_output(out_has("in place, round 1"), 60s));
  REQUIRE(b->wait_output(out_has("in place, round 1"), 60s));

  TempDir dir;
  const std::string recovery = R"JS((() => {
    const run = document.querySelector('section.run[data-run="job"]');
    const box = run && run.querySelector('.recovery');
    const events = [...document.querySelectorAll('#events li')].map((li) => li.innerText);
    if (!box || box.dataset.round !== '2' || box.dataset.resumed !== 'all' ||
        !events.some((t) => t.includes('in_place_resumed'))) return null;
    const phases = [...box.querySelectorAll('li.ph')].map((p) => p.dataset.phase + '=' +
        p.className.split(' ')[1]).join(',');
    return box.dataset.mode + ' | ' + box.innerText.split('\n')[0] + ' | ' + phases + ' | in place ' +
        run.querySelector('dd.in-place').innerText + ' | ' +
        events.filter((t) => t.includes('in_place_resumed') || t.includes('round_formed')).join(' / ');
  })())JS";
  const std::string shot = dir.file("live_page.png");
  Proc driver({kPython, LIVE_PAGE_DRIVER, "--chromium", kChromium, "--profile", dir.file("profile"),
               "--url", "http://127.0.0.1:" + std::to_string(server.page_port) + "/",
               "--screenshot", shot, "--kill", std::to_string(b->pid()), "--timeout", "30",
               "--until-1", until(1, "rows.length === 2"), "--until-2", recovery, "--screenshot-2",
               dir.file("after.png")});
  const auto code = driver.wait(180s);
  const std::string& out = driver.out();
  INFO(out << driver.err() << a->out() << a->err());
  REQUIRE(code == 0);
  CHECK(b->wait(30s) == 128 + SIGKILL);
  // The first view has no recovery yet; after the kill, the one survivor's recovery in place,
  // every phase done, the resumed event with its phases, round 2 formed with one in place.
  const std::string then = step(out, "then");
  CHECK_THAT(then, Catch::StartsWith("in_place | Last recovery: round 2, in place on 1 of 1 node(s), "));
  CHECK_THAT(then, Catch::Contains("noticed=done,aborted=done,re-formed=done,resumed=done | in place 1 |"));
  CHECK(std::regex_search(then, std::regex(R"(resumed in place \(1/1\): abort \d+ms, rendezvous \d+(\.\d)?m?s, )"
                                           R"(re-form \d+(\.\d)?m?s)")));
  CHECK_THAT(then, Catch::Contains("round 2: 1 node(s), world size 1, 1 in place"));
  // The survivor's worker went on in its own process.
  CHECK(a->wait_output(out_has("re-formed in place as rank 0 of 1, round 2"), 30s));
  std::error_code ec;
  const std::string copy = std::regex_replace(LIVE_PAGE_SCREENSHOT, std::regex("\\.png$"), "_in_place.png");
  CHECK_THAT(step(out, "screenshot 2"), Catch::Matches(R"(\d+x\d+ \d+ bytes \d+ distinct)"));
  std::filesystem::copy_file(dir.file("after.png"), copy,
                             std::filesystem::copy_options::overwrite_existing, ec);
  CHECK_FALSE(ec);  // for humans: build/live_page_in_place.png, the page after the recovery
  ::kill(a->pid(), SIGTERM);
  CHECK(a->wait(30s) == 128 + SIGTERM);
}

int main(int argc, char** argv) {
  for (const std::string& bin : {kChromium, kPython}) {
    if (::access(bin.c_str(), X_OK) != 0) {
      std::printf("SKIPPED: %s is missing (scripts/setup installs chromium)\n", bin.c_str());
      return kSkipExit;
    }
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
