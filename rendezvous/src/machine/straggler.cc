#include "muster/rendezvous/straggler.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "muster/ops/median.h"
#include "muster/ops/progress_page.h"

namespace muster::rendezvous {
namespace {

// A page must keep at least the data, compute and comm kinds' times to be scored.
constexpr std::size_t kKnownKinds = worker::kComm + 1;

}  // namespace

std::string Straggler::describe() const {
  if (cause == "network") {
    return absl::StrFormat(
        "rank %d on host %s: its node's link moved %.1f MB/s, the nodes' median %.1f MB/s "
        "(network)",
        rank, node, link_mbps, link_median);
  }
  return absl::StrFormat(
      "rank %d on host %s: %.1fx the others' own work per step (%s), named "
      "at step %d",
      rank, node, slowdown, cause, step);
}

void StragglerWatch::reset() {
  ranks_.clear();
  named_.clear();
  closed_ = 0;
}

void StragglerWatch::update(int rank, const std::string& node, std::uint64_t step,
                            const std::vector<std::uint64_t>& kind_ns) {
  if (kind_ns.size() < kKnownKinds) {
    ranks_.erase(rank);  // its writer keeps no phase times: not watched
    return;
  }
  Rank& r = ranks_[rank];
  r.node = node;
  const Sample s{step, kind_ns};
  if (!r.started || step < r.latest.step || kind_ns.size() != r.start.kind_ns.size()) {
    r.start = s;  // first seen, or a page that started again
    r.started = true;
  }
  r.latest = s;
}

StragglerChange StragglerWatch::evaluate() {
  StragglerChange change;
  if (ranks_.size() < 2) return change;
  std::uint64_t advance = UINT64_MAX;
  for (const auto& [rank, r] : ranks_) advance = std::min(advance, r.latest.step - r.start.step);
  if (advance < static_cast<std::uint64_t>(std::max(1, o_.window_steps))) return change;

  // The window's own work, data and other work per step, rank by rank.
  struct Window {
    double own = 0, data = 0, work = 0;
  };
  std::map<int, Window> w;
  for (auto& [rank, r] : ranks_) {
    const double steps = static_cast<double>(r.latest.step - r.start.step);
    std::uint64_t d[8] = {};
    double total = 0;
    for (std::size_t k = 0; k < r.latest.kind_ns.size() && k < 8; ++k) {
      const std::uint64_t a = r.start.kind_ns[k], b = r.latest.kind_ns[k];
      d[k] = b > a ? b - a : 0;
      total += static_cast<double>(d[k]);
    }
    Window x;
    x.own = (total - static_cast<double>(d[worker::kComm])) / steps;
    x.data = static_cast<double>(d[worker::kData]) / steps;
    x.work = x.own - x.data;
    w[rank] = x;
    r.start = r.latest;
  }
  ++closed_;
  const std::size_t keep = static_cast<std::size_t>(std::max(1, o_.windows));
  for (auto& [rank, r] : ranks_) {
    std::vector<double> own, data, work;
    for (const auto& [other, x] : w) {
      if (other == rank) continue;
      own.push_back(x.own);
      data.push_back(x.data);
      work.push_back(x.work);
    }
    const double m = median(own);
    const Window& me = w[rank];
    r.ratios.push_back(m > 0 ? me.own / m : 0);
    // Its data is the cause when its other work is as fast as the others': a slow host (or a
    // stopped process) slows every phase, a slow input pipeline only the data.
    const double mw = median(work);
    r.data.push_back(!(mw > 0 && me.work / mw >= o_.ratio) && me.data > median(data));
    if (r.ratios.size() > keep) {
      r.ratios.erase(r.ratios.begin());
      r.data.erase(r.data.begin());
    }
  }

  const std::size_t majority = keep / 2 + 1;
  for (auto& [rank, r] : ranks_) {
    std::vector<double> slow;
    std::size_t data_slow = 0;
    for (std::size_t i = 0; i < r.ratios.size(); ++i) {
      if (r.ratios[i] >= o_.ratio) {
        slow.push_back(r.ratios[i]);
        if (r.data[i]) ++data_slow;
      }
    }
    auto it = named_.find(rank);
    if (it == named_.end() && slow.size() >= majority) {
      Straggler s;
      s.rank = rank;
      s.node = r.node;
      s.cause = data_slow * 2 > slow.size() ? "data" : "compute";
      s.slowdown = median(slow);
      s.step = r.latest.step;
      named_[rank] = s;
      change.named.push_back(s);
    } else if (it != named_.end() && slow.size() <= 1) {
      change.cleared.push_back(it->second);
      named_.erase(it);
    } else if (it != named_.end() && !slow.empty()) {
      it->second.slowdown = median(slow);  // still named: how slow it is now
    }
  }
  return change;
}

std::string exclusion_kept(const ExclusionCase& c) {
  using std::chrono::duration;
  if (!c.in_place) return "not every node runs in place";
  if (c.cause == "data") return "its cause is data loading";
  if (c.nodes - 1 < c.min_nodes && !c.spare) {
    return absl::StrFormat("at MIN nodes (%d) with no spare", c.min_nodes);
  }
  if (!c.spare) {
    const double worth = static_cast<double>(c.nodes) / (c.nodes - 1);
    if (c.slowdown <= worth) {
      return absl::StrFormat("%.2fx is not beyond N/(N-1) = %.2fx", c.slowdown, worth);
    }
  } else if (c.slowdown <= 1) {
    return "not slower than the others";
  }
  const double lost_s = duration<double>(c.named_for).count() * (1 - 1 / c.slowdown);
  const double reform_s = duration<double>(c.reform_cost).count();
  if (lost_s <= reform_s) {
    return absl::StrFormat("it has cost %.1f s, a re-form costs %.1f s", lost_s, reform_s);
  }
  return "";
}

void LinkJudge::reset() {
  reports_.clear();
  slow_.clear();
  named_.clear();
}

void LinkJudge::update(const std::string& node, std::vector<Link> links) {
  if (links.empty()) return;
  auto& q = reports_[node];
  q.push_back(std::move(links));
  while (static_cast<int>(q.size()) > limits::kLinkReports) q.pop_front();
}

LinkJudge::Change LinkJudge::evaluate() {
  Change change;
  std::map<std::string, std::string> owner;  // address -> node
  for (const auto& [node, q] : reports_) {
    for (const auto& r : q) {
      for (const Link& l : r) owner[l.local] = node;
    }
  }
  std::map<std::string, double> best;
  for (const auto& [node, q] : reports_) {
    for (const auto& r : q) {
      for (const Link& l : r) {
        double& mine = best[node];
        mine = std::max(mine, l.mbps);
        if (auto o = owner.find(l.remote); o != owner.end()) {
          double& theirs = best[o->second];
          theirs = std::max(theirs, l.mbps);
        }
      }
    }
  }
  std::vector<double> values;
  for (const auto& [node, b] : best) {
    if (b > 0) values.push_back(b);
  }
  if (values.size() < 3) return change;  // two cannot tell which end is slow
  const double m = median(values);
  const std::size_t keep = static_cast<std::size_t>(std::max(windows_, 1));
  const std::size_t majority = keep / 2 + 1;
  for (const auto& [node, b] : best) {
    auto& q = slow_[node];
    q.push_back(b > 0 && b < ratio_ * m);
    while (q.size() > keep) q.pop_front();
    const std::size_t slow = static_cast<std::size_t>(std::count(q.begin(), q.end(), true));
    auto it = named_.find(node);
    if (it == named_.end() && slow >= majority) {
      SlowLink s{node, b, m};
      named_[node] = s;
      change.named.push_back(s);
    } else if (it != named_.end() && slow <= 1) {
      change.cleared.push_back(it->second);
      named_.erase(it);
    } else if (it != named_.end()) {
      it->second.mbps = b;
      it->second.median = m;
    }
  }
  return change;
}

}  // namespace muster::rendezvous
