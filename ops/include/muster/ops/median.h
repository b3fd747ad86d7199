// The median of a few numbers (the straggler watch's windows, the pre-flight's probes): the
// middle one, or the mean of the two middle ones; 0 for none.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace muster {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const std::size_t mid = v.size() / 2;
  const auto m = v.begin() + static_cast<std::ptrdiff_t>(mid);
  std::nth_element(v.begin(), m, v.end());
  if (v.size() % 2 == 1) return *m;
  return (*std::max_element(v.begin(), m) + *m) / 2;
}

}  // namespace muster
