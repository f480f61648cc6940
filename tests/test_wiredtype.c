/* 16-bit wire dtypes end to end (protocol 2.3): a worker pushing and/or
 * pulling bfloat16 or fp16 against real psd processes trains to exactly
 * the values a float32 server computes from the 16-bit-rounded gradients
 * (and receives those values rounded), per client and per variable; a psd
 * announcing an older minor gets float32 from the same client; psd's byte
 * counters count wire bytes; a worker using a shared-memory segment gets
 * float32 (16-bit is a TCP matter); bad configurations are refused by name. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tu_stats.h"
#include "wire.h"

#define NPS 2
/* Elements of the big variable: above the split threshold below, so it
 * is cut into slices on both servers. */
#define BIG 3000
#define SMALL 37
#define STEPS 6
/* SGD's rate: a power of two, so lr * g is exact and psd's arithmetic is
 * reproduced bit for bit whatever the compiler contracts. */
#define LR 0.5f

static void start_ps(tu_psd *ps, char hosts[][64], const char **hp, const char *minor) {
  for (int i = 0; i < NPS; i++) {
    char idx[16];
    snprintf(idx, sizeof idx, "%d", i);
    const char *args[] = {"--ps-index", idx, "--num-ps", "2", "--workers", "1",
                          "--startup-timeout", "60", minor ? "--protocol-minor" : NULL, minor,
                          NULL};
    ck_assert_msg(tu_psd_start(&ps[i], args) == 0, "psd %d did not start", i);
  }
  tu_hosts(ps, NPS, hosts, hp);
}

/* transport: a ps_transport; 16-bit dtypes are a TCP matter (§1a). */
static ps_client *connect_dt(const char **hp, int push, int pull, int transport) {
  ps_config cfg;
  ps_config_init(&cfg);
  cfg.hosts = hp;
  cfg.num_ps = NPS;
  cfg.num_workers = 1;
  cfg.telemetry = "off";
  cfg.no_signal_handlers = 1;
  cfg.split_threshold = 4096; /* BIG (12000 bytes) is split over both */
  cfg.max_slice_bytes = 4096; /* ... into several slices */
  cfg.push_dtype = push;
  cfg.pull_dtype = pull;
  cfg.transport = transport;
  char err[512];
  ps_client *c = NULL;
  ck_assert_msg(ps_client_create(&cfg, &c, err, sizeof err) == 0, "create: %s", err);
  return c;
}

/* x as dtype dt sees it (float32: x itself). */
static float rounded(int dt, float x) {
  if (dt == PS_WIRE_BF16) return ps__bf16_to_f32(ps__f32_to_bf16(x));
  if (dt == PS_WIRE_FP16) return ps__fp16_to_f32(ps__f32_to_fp16(x));
  return x;
}

static uint64_t rng(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* A value whose 16-bit forms need rounding: 24 random significant bits,
 * scaled by 2^-26 .. 2^9 (fp16's subnormals included; no overflow). */
static float value(uint64_t *s) {
  uint64_t r = rng(s);
  float m = (float)(r & 0xffffff) / (float)0x1000000 + 0.5f;
  float v = ldexpf(m, (int)((r >> 24) % 36) - 26);
  return (r >> 40) & 1 ? -v : v;
}

/* psd's Stats for worker 0 on every ps: gradient and parameter bytes. */
/* One run: variables big and small (small's dtypes set per variable when
 * vpush/vpull are not -1) trained STEPS steps by one worker; after every
 * step each variable's data must be exactly the float32 master (updated
 * from the rounded gradients) rounded to its pull dtype. `eff` (0: as
 * configured) forces the dtypes expected on the wire (an old server). */
typedef struct run {
  int push, pull;     /* client's dtypes */
  int vpush, vpull;   /* small's own (-1: the client's) */
  const char *minor;  /* --protocol-minor of the servers, or NULL */
  int as_f32;         /* expect float32 on the wire whatever was asked */
  int transport;      /* a ps_transport (0: TCP, where 16-bit applies) */
} run;

static void train(const run *rn) {
  tu_psd ps[NPS];
  char hosts[NPS][64];
  const char *hp[NPS];
  start_ps(ps, hosts, hp, rn->minor);
  ps_client *c = connect_dt(hp, rn->push, rn->pull,
                            rn->transport ? rn->transport : PS_TRANSPORT_TCP);
  unsigned seed = tu_seed("wiredtype");
  uint64_t s = seed;
  const int64_t shape[2][1] = {{BIG}, {SMALL}};
  const size_t numel[2] = {BIG, SMALL};
  float *master[2];
  ps_var *v[2];
  ps_optimizer o;
  ps_optimizer_default(&o, LR);
  for (int k = 0; k < 2; k++) {
    master[k] = malloc(numel[k] * sizeof(float));
    ck_assert_ptr_nonnull(master[k]);
    for (size_t i = 0; i < numel[k]; i++) master[k][i] = value(&s);
    ck_assert_int_eq(ps_client_var_create_values(c, k ? "small" : "big", shape[k], 1,
                                                 master[k], &o, &v[k]), 0);
  }
  ck_assert_int_eq(ps_var_set_wire_dtype(v[1], rn->vpush, rn->vpull), 0);
  int push[2] = {rn->push, rn->vpush >= 0 ? rn->vpush : rn->push};
  int pull[2] = {rn->pull, rn->vpull >= 0 ? rn->vpull : rn->pull};
  if (rn->as_f32) push[0] = push[1] = pull[0] = pull[1] = PS_WIRE_F32;
  /* Created before the per-variable setting: its first pull used the
   * client's dtype. */
  uint64_t want_in = 0, want_out = 0;
  for (int k = 0; k < 2; k++) {
    int dt0 = rn->as_f32 ? PS_WIRE_F32 : rn->pull;
    const float *d = ps_var_data(v[k]);
    for (size_t i = 0; i < numel[k]; i++)
      ck_assert_msg(d[i] == rounded(dt0, master[k][i]), "var %d [%zu]: created as %a, want %a",
                    k, i, (double)d[i], (double)rounded(dt0, master[k][i]));
    want_out += numel[k] * (dt0 == PS_WIRE_F32 ? 4 : 2);
  }
  uint64_t step = 0;
  for (int t = 0; t < STEPS; t++) {
    for (int k = 0; k < 2; k++) {
      float *g = ps_var_grad(v[k]);
      for (size_t i = 0; i < numel[k]; i++) {
        g[i] = value(&s);
        master[k][i] = master[k][i] - LR * rounded(push[k], g[i]); /* psd's SGD */
      }
      want_in += numel[k] * (push[k] == PS_WIRE_F32 ? 4 : 2);
      want_out += numel[k] * (pull[k] == PS_WIRE_F32 ? 4 : 2);
    }
    ck_assert_msg(ps_client_step(c, &step, NULL) == 0, "step %d: %s", t,
                  ps_client_errmsg(c));
    for (int k = 0; k < 2; k++) {
      const float *d = ps_var_data(v[k]);
      for (size_t i = 0; i < numel[k]; i++)
        ck_assert_msg(d[i] == rounded(pull[k], master[k][i]),
                      "step %d var %d [%zu]: pulled %a, want %a (master %a; seed %u)", t, k, i,
                      (double)d[i], (double)rounded(pull[k], master[k][i]),
                      (double)master[k][i], seed);
    }
  }
  /* psd counts the bytes that crossed the wire. */
  uint64_t in, out;
  tu_worker_bytes(ps, NPS, 0, &in, &out);
  ck_assert_msg(in == want_in && out == want_out,
                "psd counted %llu gradient and %llu parameter bytes, want %llu and %llu",
                (unsigned long long)in, (unsigned long long)out, (unsigned long long)want_in,
                (unsigned long long)want_out);
  ck_assert_int_eq(ps_client_finish(c), 0);
  ps_client_destroy(c);
  for (int i = 0; i < NPS; i++) tu_psd_kill(&ps[i]);
  free(master[0]);
  free(master[1]);
}

START_TEST(bf16_push_and_pull) {
  run r = {PS_WIRE_BF16, PS_WIRE_BF16, -1, -1, NULL, 0, 0};
  train(&r);
}
END_TEST

START_TEST(fp16_push_and_pull) {
  run r = {PS_WIRE_FP16, PS_WIRE_FP16, -1, -1, NULL, 0, 0};
  train(&r);
}
END_TEST

/* Push and pull separately, and a variable of its own dtypes beside. */
START_TEST(mixed_per_client_and_per_variable) {
  run a = {PS_WIRE_BF16, PS_WIRE_F32, PS_WIRE_F32, PS_WIRE_FP16, NULL, 0, 0};
  train(&a);
  run b = {PS_WIRE_F32, PS_WIRE_FP16, PS_WIRE_BF16, -1, NULL, 0, 0};
  train(&b);
}
END_TEST

/* Servers announcing 2.2 (they would refuse 16-bit data: test_hostile's
 * minor_2 case) get float32 from a client configured for bf16. */
START_TEST(older_minor_gets_float32) {
  run r = {PS_WIRE_BF16, PS_WIRE_FP16, PS_WIRE_FP16, PS_WIRE_BF16, "2", 1, 0};
  train(&r);
}
END_TEST

/* A worker whose tensors go through a shared-memory segment sends and
 * receives float32 whatever dtypes it was given (docs/protocol.md §1a). */
START_TEST(shared_memory_gets_float32) {
  run r = {PS_WIRE_BF16, PS_WIRE_FP16, PS_WIRE_FP16, PS_WIRE_BF16, NULL, 1, PS_TRANSPORT_SHM};
  train(&r);
}
END_TEST

START_TEST(bad_dtypes_refused) {
  ps_config cfg;
  ps_config_init(&cfg);
  const char *hp[1] = {"127.0.0.1:1"};
  cfg.hosts = hp;
  cfg.num_ps = 1;
  cfg.num_workers = 1;
  cfg.pull_dtype = 3;
  char err[512];
  ps_client *c = NULL;
  ck_assert_int_eq(ps_client_create(&cfg, &c, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "pull 3"), "%s", err);
  setenv("PS_HOSTS", "127.0.0.1:1", 1);
  setenv("PS_WORKER_INDEX", "0", 1);
  setenv("PS_NUM_WORKERS", "1", 1);
  setenv("PS_WIRE_DTYPE", "bf16", 1);
  setenv("PS_WIRE_PULL_DTYPE", "half", 1);
  ck_assert_int_eq(ps_client_create_from_env(&c, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "PS_WIRE_PULL_DTYPE='half'"), "%s", err);
  unsetenv("PS_WIRE_PULL_DTYPE");
  setenv("PS_WIRE_DTYPE", "float16", 1);
  ck_assert_int_eq(ps_client_create_from_env(&c, err, sizeof err), PS_EINVAL);
  ck_assert_msg(strstr(err, "PS_WIRE_DTYPE='float16'"), "%s", err);
  unsetenv("PS_WIRE_DTYPE");
  unsetenv("PS_HOSTS");
  ck_assert_int_eq(ps_var_set_wire_dtype(NULL, 0, 0), PS_EINVAL);
}
END_TEST

/* PS_WIRE_DTYPE reaches the client: a bf16 run through the environment. */
START_TEST(env_selects_bf16) {
  tu_psd ps[NPS];
  char hosts[NPS][64];
  const char *hp[NPS];
  start_ps(ps, hosts, hp, NULL);
  char list[200];
  snprintf(list, sizeof list, "%s,%s", hp[0], hp[1]);
  setenv("PS_HOSTS", list, 1);
  setenv("PS_WORKER_INDEX", "0", 1);
  setenv("PS_NUM_WORKERS", "1", 1);
  setenv("PS_SIGNALS", "0", 1);
  setenv("PS_TELEMETRY", "off", 1);
  setenv("PS_WIRE_DTYPE", "bf16", 1);
  setenv("PS_WIRE_PUSH_DTYPE", "f32", 1);
  setenv("PS_TRANSPORT", "tcp", 1); /* 16-bit travels over TCP only */
  ps_client *c = NULL;
  char err[512];
  ck_assert_msg(ps_client_create_from_env(&c, err, sizeof err) == 0, "%s", err);
  const int64_t shape[1] = {5};
  const float v0[5] = {1.00390625f, -3.0078125f, 1e-3f, 7.0f, 0.1f};
  ps_var *v;
  ck_assert_int_eq(ps_client_var_create_values(c, "e", shape, 1, v0, NULL, &v), 0);
  for (int i = 0; i < 5; i++)
    ck_assert_msg(ps_var_data(v)[i] == rounded(PS_WIRE_BF16, v0[i]), "[%d] %a", i,
                  (double)ps_var_data(v)[i]);
  ck_assert(ps_var_data(v)[0] != v0[0]); /* a tie: rounded to even (1.0) */
  uint64_t in, out;
  tu_worker_bytes(ps, NPS, 0, &in, &out);
  ck_assert_uint_eq(out, 5 * 2);
  ps_client_destroy(c);
  for (const char *const *e = (const char *const[]){"PS_HOSTS", "PS_WORKER_INDEX",
                                                     "PS_NUM_WORKERS", "PS_SIGNALS",
                                                     "PS_TELEMETRY", "PS_WIRE_DTYPE",
                                                     "PS_WIRE_PUSH_DTYPE", "PS_TRANSPORT",
                                                     NULL};
       *e; e++)
    unsetenv(*e);
  for (int i = 0; i < NPS; i++) tu_psd_kill(&ps[i]);
}
END_TEST

Suite *suite_wiredtype(void) {
  Suite *s = suite_create("wiredtype");
  TCase *tc = tcase_create("train");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, bf16_push_and_pull);
  tcase_add_test(tc, fp16_push_and_pull);
  tcase_add_test(tc, mixed_per_client_and_per_variable);
  tcase_add_test(tc, older_minor_gets_float32);
  tcase_add_test(tc, shared_memory_gets_float32);
  tcase_add_test(tc, bad_dtypes_refused);
  tcase_add_test(tc, env_selects_bf16);
  suite_add_tcase(s, tc);
  return s;
}
