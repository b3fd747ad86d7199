// The standard gRPC health service (grpc.health.v1.Health, gRPC's own implementation) on the
// rendezvous server's ports, for orchestrators' probes (docs/operations.md, "Health checks"):
// the server ("") and each of its services report SERVING while it is up and NOT_SERVING
// from the moment its shutdown starts.
#pragma once

#include <grpcpp/grpcpp.h>

namespace muster::rendezvous {

// Before a grpc::ServerBuilder is made (gRPC reads a process-wide switch there).
void enable_health_service();
// After BuildAndStart, and first thing in shutdown.
void set_serving(grpc::Server& server, bool serving);
// A standby replica (rdzvd --etcd) is up ("" SERVING) but serves no run: muster.v1.Rendezvous
// and muster.v1.Store report NOT_SERVING until it leads.
void set_leading(grpc::Server& server, bool leading);

}  // namespace muster::rendezvous
