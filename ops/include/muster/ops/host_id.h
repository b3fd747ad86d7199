// Which machine and network namespace this process runs in. Two processes with the same
// identity can reach each other's abstract Unix-domain sockets (which live in a network
// namespace), so the rendezvous store and the TCP ring use those instead of TCP loopback.
#pragma once

#include <string>

namespace muster::ops {

// "<boot id> <network namespace>", e.g. "0b9c...-41d2 net:[4026531840]"; empty when either
// cannot be read (then nothing is assumed to be local).
std::string host_identity();

}  // namespace muster::ops
