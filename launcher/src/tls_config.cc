#include "tls_config.h"

#include "absl/strings/str_cat.h"

namespace muster::launcher {

absl::Status resolve_tls(LaunchConfig& c, const std::map<std::string, std::string>& env,
                         bool cluster) {
  namespace rdzv = muster::rendezvous;
  // Key by key: --rdzv_conf wins over the environment.
  const rdzv::ClientTlsFiles from_env = rdzv::client_tls_files_from_env(env);
  rdzv::ClientTlsFiles& files = c.rdzv_conf.tls;
  for (auto [given, fallback] : {std::pair{&files.ca, &from_env.ca},
                                 std::pair{&files.cert, &from_env.cert},
                                 std::pair{&files.key, &from_env.key},
                                 std::pair{&files.server_name, &from_env.server_name}}) {
    if (given->empty()) *given = *fallback;
  }
  const rdzv::ServerTlsFiles& server = c.server_tls.files;
  if (cluster && server.any() && !c.rdzv_endpoint.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert, --tls_key and --tls_ca are for the rendezvous this command hosts; with "
        "--rdzv_endpoint it hosts none (give them to the server there)");
  }
  auto loaded = rdzv::load_server_tls(server);
  if (!loaded.ok()) return loaded.status();
  c.server_tls = std::move(*loaded);
  if (c.server_tls.enabled() && files.ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert: the agents verify the server they reach, this launch's own too: give "
        "--rdzv_conf tls_ca=CA_FILE (or MUSTER_TLS_CA)");
  }
  if (c.server_tls.mutual() && files.cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_ca asks every agent for a client certificate, this launch's own too: give "
        "--rdzv_conf tls_cert=FILE,tls_key=FILE (or MUSTER_TLS_CERT, MUSTER_TLS_KEY)");
  }
  if (cluster) return absl::OkStatus();
  auto client = rdzv::load_client_tls(files);
  if (!client.ok()) return client.status();
  c.client_tls = std::move(*client);
  return absl::OkStatus();
}

}  // namespace muster::launcher
