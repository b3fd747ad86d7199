// Metrics for Prometheus: a registry of counter, gauge and histogram families, each with a
// fixed list of label names, rendered in Prometheus' text exposition format (0.0.4): HELP and
// TYPE lines, escaped label values, histograms as cumulative _bucket{le=...} series (the last
// one le="+Inf"), _sum and _count. The series names and labels muster exports are listed in
// docs/operations.md, "Metrics".
//
// Threads: everything here may be used from any thread. A series' update is one atomic
// operation, without a lock or an allocation; finding a series by its label values takes the
// family's lock (and allocates the first time), so hot paths look a series up once and keep
// the reference (it stays valid as long as the registry).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "muster/ops/http_server.h"

namespace muster::ops {

// Bounds (docs/operations.md, "Metrics"). A family holds at most kMaxSeriesPerFamily label
// sets; every later new one is counted in one extra series whose label values are all
// kOverflowLabelValue, so a label fed from outside can never grow a scrape without bound. A
// label value longer than kMaxLabelValueBytes is cut to it (at a UTF-8 character boundary).
inline constexpr std::size_t kMaxSeriesPerFamily = 256;
inline constexpr std::size_t kMaxLabelValueBytes = 128;
inline constexpr std::string_view kOverflowLabelValue = "_overflow";

// The buckets (upper bounds, seconds) of every recovery-time histogram, the server's and the
// agents': from 50 ms to 10 min.
inline const std::vector<double> kRecoveryBucketsSeconds = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                                            10,   30,  60,   120, 300, 600};

// What a scrape is answered with (Prometheus' text format).
inline constexpr std::string_view kPrometheusContentType =
    "text/plain; version=0.0.4; charset=utf-8";

class Counter {
 public:
  // Adds `by` (a negative or NaN `by` is ignored: a counter only goes up).
  void inc(double by = 1.0);
  // For a count kept elsewhere and read at scrape time (a collector): the counter takes
  // `total` when it is larger than the value it has.
  void mirror(double total);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void inc(double by = 1.0) { value_.fetch_add(by, std::memory_order_relaxed); }
  void dec(double by = 1.0) { value_.fetch_sub(by, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: the buckets' upper bounds, ascending and finite (+Inf is implied).
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);

  const std::vector<double>& bounds() const { return bounds_; }
  // Observations at or below bounds()[i] (cumulative); i == bounds().size() is +Inf.
  std::uint64_t cumulative_count(std::size_t i) const;
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;  // per bucket, not cumulative
  std::atomic<std::uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

class Registry;

// One metric name and its series, one per label set.
template <class M>
class Family {
 public:
  // The series with these label values, one per label name in order (missing ones are "",
  // extra ones are ignored); created at zero the first time. See kMaxSeriesPerFamily.
  M& with(const std::vector<std::string_view>& values);
  // The one series of a family without labels.
  M& get() { return with({}); }

  const std::string& name() const { return name_; }

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds)
      : name_(std::move(name)),
        help_(std::move(help)),
        label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}
  void render(std::string& out) const;

  const std::string name_, help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> series_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<M> overflow_ ABSL_GUARDED_BY(mu_);
};

// Defined in metrics.cc for the three kinds.
extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The family of that name, made on first use. REQUIRES: check() is OK for it. A family
  // that breaks the rules is a programming error: the process prints check()'s message and
  // aborts at start-up (no exception leaves the module).
  Family<Counter>& counter(const std::string& name, const std::string& help,
                           std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names, std::vector<double> bounds);

  enum class Kind { kCounter, kGauge, kHistogram };
  // Whether a family may be registered: a valid Prometheus metric name
  // ([a-zA-Z_:][a-zA-Z0-9_:]*), label names ([a-zA-Z_][a-zA-Z0-9_]*, not "__..." nor, for a
  // histogram, "le"), finite ascending buckets; a name registered before must come again with
  // the same kind, labels and buckets. InvalidArgument saying which rule it breaks.
  absl::Status check(const std::string& name, Kind kind, const std::vector<std::string>& labels,
                     const std::vector<double>& bounds = {}) const;

  // A function run before every render() (on the scraping thread), to refresh gauges and
  // mirrored counters from state kept elsewhere. It must be bounded in time. Returns an id
  // for remove_collector().
  int add_collector(std::function<void()> collect);
  // After this returns the collector is not running and will not run again (it waits for a
  // render that is running it).
  void remove_collector(int id);

  // Runs the collectors, then writes every family, in the order they were made.
  std::string render();

  class Entry;

 private:
  struct Collector;
  Entry& find_or_add(const std::string& name, Kind kind, const std::vector<std::string>& labels,
                     const std::vector<double>& bounds);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> families_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::shared_ptr<Collector>> collectors_ ABSL_GUARDED_BY(mu_);
  int next_collector_ ABSL_GUARDED_BY(mu_) = 1;
};

// Adds muster_process_resident_memory_bytes (from /proc/self/statm) to `registry`.
void add_process_metrics(Registry& registry);

// The routes of a metrics endpoint: GET /metrics renders `registry` (which must outlive the
// HttpServer serving them).
HttpRoutes metrics_routes(Registry& registry);

// Helpers for the text format, exposed for tests: a label value or HELP text escaped, and a
// sample value (shortest form that reads back the same; +Inf, -Inf, NaN).
std::string escape_label_value(std::string_view v);
std::string escape_help(std::string_view v);
std::string format_value(double v);

}  // namespace muster::ops
