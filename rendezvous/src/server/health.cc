#include "server/health.h"

#include <grpcpp/health_check_service_interface.h>

namespace muster::rendezvous {

void enable_health_service() { grpc::EnableDefaultHealthCheckService(true); }

void set_serving(grpc::Server& server, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  // The named services too, for probes that ask for one (grpc_health_probe -service=...).
  health->SetServingStatus("muster.v1.Rendezvous", serving);
  health->SetServingStatus("muster.v1.Store", serving);
  health->SetServingStatus(serving);  // "" and every name set so far
}

void set_leading(grpc::Server& server, bool leading) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("muster.v1.Rendezvous", leading);
  health->SetServingStatus("muster.v1.Store", leading);
}

}  // namespace muster::rendezvous
