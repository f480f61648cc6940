/* psd.c - psd's entry point: options, logging, the server loop. */
#include <stdio.h>

#include "config.h"
#include "psdlog.h"
#include "server.h"

int main(int argc, char **argv) {
  psd_config cfg;
  char err[512];
  int rc = psd_config_parse(&cfg, argc, argv, err, sizeof err);
  if (rc == 1) return 0;
  if (rc != 0) {
    fprintf(stderr, "psd: %s\n", err);
    return PSD_EXIT_USAGE;
  }
  if (psd_config_load_secret(&cfg, err, sizeof err) != 0) {
    fprintf(stderr, "psd: %s\n", err);
    return PSD_EXIT_USAGE;
  }
  psd_log_init(cfg.name, cfg.log_level);
  psd_info("slices may take %.0f bytes (%s)", cfg.max_memory, cfg.max_memory_from);
  psd_server srv;
  if (psd_server_init(&srv, &cfg) != 0) {
    psd_server_free(&srv);
    return PSD_EXIT_STARTUP;
  }
  int code = psd_server_run(&srv);
  psd_server_free(&srv);
  psd_info("exit status %d", code);
  return code;
}
