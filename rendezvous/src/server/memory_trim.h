// Returning freed memory to the system. glibc keeps what a burst of large requests freed
// (parked waits with long key lists, 4 MiB values, big refused messages) in its arenas, one per
// gRPC thread, so a daemon's resident size would stay at its peak after the clients leave.
// Private to the rendezvous library.
#pragma once

#include <cstddef>

namespace muster::rendezvous {

// When at least `threshold` more bytes are free in malloc than after the last trim, gives
// them back (malloc_trim) and returns true. Cheap when there is nothing to give: one walk
// over the arenas' bins. Process-wide (malloc is): any thread.
bool trim_free_memory(std::size_t threshold);

}  // namespace muster::rendezvous
