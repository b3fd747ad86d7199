#include "muster/ops/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "muster/ops/build_info.h"

namespace muster::ops {
namespace {

enum Kind { kCounter = 0, kGauge = 1, kHistogram = 2 };
constexpr const char* kKindName[] = {"counter", "gauge", "histogram"};

bool valid_name(std::string_view n, bool colons) {
  if (n.empty()) return false;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (colons && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Cut to the bound, never inside a UTF-8 sequence (Prometheus wants valid UTF-8).
std::string_view cut_label_value(std::string_view v) {
  if (v.size() <= kMaxLabelValueBytes) return v;
  std::size_t n = kMaxLabelValueBytes;
  while (n > 0 && (static_cast<unsigned char>(v[n]) & 0xC0) == 0x80) --n;
  return v.substr(0, n);
}

void append_labels(std::string& out, const std::vector<std::string>& names,
                   const std::vector<std::string>& values, std::string_view le = {}) {
  if (names.empty() && le.empty()) return;
  out += '{';
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, names[i], "=\"", escape_label_value(values[i]), "\"");
  }
  if (!le.empty()) {
    if (!names.empty()) out += ',';
    out += "le=\"";
    out += le;
    out += '"';
  }
  out += '}';
}

template <class M>
std::unique_ptr<M> make_series(const std::vector<double>& bounds) {
  if constexpr (std::is_same_v<M, Histogram>) {
    return std::make_unique<Histogram>(bounds);
  } else {
    return std::make_unique<M>();
  }
}

void add_to(std::atomic<double>& a, double by) { a.fetch_add(by, std::memory_order_relaxed); }

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string escape_help(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  if (ec != std::errc()) return "NaN";
  return std::string(buf, end);
}

void Counter::inc(double by) {
  if (!(by > 0)) return;  // also NaN
  add_to(value_, by);
}

void Counter::mirror(double total) {
  double cur = value_.load(std::memory_order_relaxed);
  while (total > cur &&
         !value_.compare_exchange_weak(cur, total, std::memory_order_relaxed)) {
  }
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      buckets_(std::make_unique<std::atomic<std::uint64_t>[]>(bounds_.size() + 1)) {}

void Histogram::observe(double v) {
  if (std::isnan(v)) return;
  // The first bucket whose bound is >= v (Prometheus' buckets are "less or equal").
  const auto at = std::lower_bound(bounds_.begin(), bounds_.end(), v);
  const std::size_t i = static_cast<std::size_t>(at - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  add_to(sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t Histogram::cumulative_count(std::size_t i) const {
  std::uint64_t n = 0;
  for (std::size_t b = 0; b <= i && b <= bounds_.size(); ++b) {
    n += buckets_[b].load(std::memory_order_relaxed);
  }
  return n;
}

template <class M>
M& Family<M>::with(const std::vector<std::string_view>& values) {
  std::vector<std::string> key(label_names_.size());
  for (std::size_t i = 0; i < key.size() && i < values.size(); ++i) {
    key[i] = std::string(cut_label_value(values[i]));
  }
  auto make = [&] { return make_series<M>(bounds_); };
  absl::MutexLock lock(&mu_);
  auto it = series_.find(key);
  if (it != series_.end()) return *it->second;
  if (series_.size() >= kMaxSeriesPerFamily) {
    if (!overflow_) overflow_ = make();
    return *overflow_;
  }
  return *series_.emplace(std::move(key), make()).first->second;
}

template <class M>
void Family<M>::render(std::string& out) const {
  const int kind = std::is_same_v<M, Counter> ? kCounter
                   : std::is_same_v<M, Gauge> ? kGauge
                                              : kHistogram;
  absl::StrAppend(&out, "# HELP ", name_, " ", escape_help(help_), "\n# TYPE ", name_, " ",
                  kKindName[kind], "\n");
  auto one = [&](const std::vector<std::string>& values, const M& m) {
    if constexpr (std::is_same_v<M, Histogram>) {
      const auto& b = m.bounds();
      for (std::size_t i = 0; i <= b.size(); ++i) {
        out += name_;
        out += "_bucket";
        append_labels(out, label_names_, values, i < b.size() ? format_value(b[i]) : "+Inf");
        absl::StrAppend(&out, " ", m.cumulative_count(i), "\n");
      }
      out += name_;
      out += "_sum";
      append_labels(out, label_names_, values);
      absl::StrAppend(&out, " ", format_value(m.sum()), "\n");
      out += name_;
      out += "_count";
      append_labels(out, label_names_, values);
      absl::StrAppend(&out, " ", m.count(), "\n");
    } else {
      out += name_;
      append_labels(out, label_names_, values);
      absl::StrAppend(&out, " ", format_value(m.value()), "\n");
    }
  };
  absl::MutexLock lock(&mu_);
  for (const auto& [values, m] : series_) one(values, *m);
  if (overflow_) {
    one(std::vector<std::string>(label_names_.size(), std::string(kOverflowLabelValue)),
        *overflow_);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// One family of any kind, in the registry's list.
class Registry::Entry {
 public:
  std::string name;
  int kind = kCounter;
  std::vector<std::string> labels;
  std::vector<double> bounds;
  std::unique_ptr<Family<Counter>> counter;
  std::unique_ptr<Family<Gauge>> gauge;
  std::unique_ptr<Family<Histogram>> histogram;
};

struct Registry::Collector {
  absl::Mutex mu;
  std::function<void()> collect ABSL_GUARDED_BY(mu);  // empty once removed
};

Registry::Registry() = default;
Registry::~Registry() = default;

absl::Status Registry::check(const std::string& name, Kind kind,
                             const std::vector<std::string>& labels,
                             const std::vector<double>& bounds) const {
  auto bad = [](auto&&... what) { return absl::InvalidArgumentError(absl::StrCat("metrics: ", what...)); };
  if (!valid_name(name, true)) return bad("bad metric name '", name, "'");
  for (const std::string& l : labels) {
    if (!valid_name(l, false) || l.rfind("__", 0) == 0 || (kind == Kind::kHistogram && l == "le")) {
      return bad("bad label name '", l, "' of ", name);
    }
  }
  if (kind == Kind::kHistogram) {
    for (std::size_t i = 0; i < bounds.size(); ++i) {
      if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
        return bad("the buckets of ", name, " must be finite and ascending");
      }
    }
  }
  absl::MutexLock lock(&mu_);
  for (const auto& e : families_) {
    if (e->name == name &&
        (e->kind != static_cast<int>(kind) || e->labels != labels || e->bounds != bounds)) {
      return bad(name, " is already registered differently");
    }
  }
  return absl::OkStatus();
}

Registry::Entry& Registry::find_or_add(const std::string& name, Kind kind,
                                       const std::vector<std::string>& labels,
                                       const std::vector<double>& bounds) {
  if (absl::Status s = check(name, kind, labels, bounds); !s.ok()) {
    std::fprintf(stderr, "%s (a programming error)\n", std::string(s.message()).c_str());
    std::abort();
  }
  absl::MutexLock lock(&mu_);
  for (auto& e : families_) {
    if (e->name == name) return *e;
  }
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->kind = static_cast<int>(kind);
  e->labels = labels;
  e->bounds = bounds;
  families_.push_back(std::move(e));
  return *families_.back();
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   std::vector<std::string> label_names) {
  Entry& e = find_or_add(name, Kind::kCounter, label_names, {});
  absl::MutexLock lock(&mu_);
  if (!e.counter) e.counter.reset(new Family<Counter>(name, help, std::move(label_names), {}));
  return *e.counter;
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names) {
  Entry& e = find_or_add(name, Kind::kGauge, label_names, {});
  absl::MutexLock lock(&mu_);
  if (!e.gauge) e.gauge.reset(new Family<Gauge>(name, help, std::move(label_names), {}));
  return *e.gauge;
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help,
                                       std::vector<std::string> label_names,
                                       std::vector<double> bounds) {
  Entry& e = find_or_add(name, Kind::kHistogram, label_names, bounds);
  absl::MutexLock lock(&mu_);
  if (!e.histogram) {
    e.histogram.reset(
        new Family<Histogram>(name, help, std::move(label_names), std::move(bounds)));
  }
  return *e.histogram;
}

int Registry::add_collector(std::function<void()> collect) {
  auto c = std::make_shared<Collector>();
  {
    absl::MutexLock lock(&c->mu);
    c->collect = std::move(collect);
  }
  absl::MutexLock lock(&mu_);
  const int id = next_collector_++;
  collectors_.emplace(id, std::move(c));
  return id;
}

void Registry::remove_collector(int id) {
  std::shared_ptr<Collector> c;
  {
    absl::MutexLock lock(&mu_);
    auto it = collectors_.find(id);
    if (it == collectors_.end()) return;
    c = std::move(it->second);
    collectors_.erase(it);
  }
  absl::MutexLock lock(&c->mu);  // waits for a render running it
  c->collect = nullptr;
}

std::string Registry::render() {
  // Collectors run without the registry's lock: they may be slow (bounded) and may look up
  // series, and a collector being removed meanwhile is skipped.
  std::vector<std::shared_ptr<Collector>> collectors;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, c] : collectors_) collectors.push_back(c);
  }
  for (const auto& c : collectors) {
    absl::MutexLock lock(&c->mu);
    if (c->collect) c->collect();
  }
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& e : families_) {
    if (e->counter) e->counter->render(out);
    if (e->gauge) e->gauge->render(out);
    if (e->histogram) e->histogram->render(out);
  }
  return out;
}

void add_process_metrics(Registry& registry) {
  registry
      .gauge("muster_build_info", "1, labelled with the build's version and commit",
             {"version", "commit"})
      .with({build_version(), build_commit()})
      .set(1);
  Gauge& rss = registry
                   .gauge("muster_process_resident_memory_bytes",
                          "Resident memory of this process, in bytes (/proc/self/statm)")
                   .get();
  const long page = ::sysconf(_SC_PAGESIZE);
  registry.add_collector([&rss, page] {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr) return;
    unsigned long long size = 0, resident = 0;
    if (std::fscanf(f, "%llu %llu", &size, &resident) == 2) {
      rss.set(static_cast<double>(resident) * static_cast<double>(page));
    }
    std::fclose(f);
  });
}

HttpRoutes metrics_routes(Registry& registry) {
  HttpRoutes routes;
  routes["/metrics"] = [&registry](const HttpRequest&) {
    return HttpResponse{200, std::string(kPrometheusContentType), registry.render()};
  };
  return routes;
}

}  // namespace muster::ops
