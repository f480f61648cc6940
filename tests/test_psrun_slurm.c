/* psrun in Slurm steps, run for real: every task a real psrun process
 * with a fake Slurm environment on localhost (no slurmctld: the
 * rendezvous uses the key mode), psd and tiny_worker under it. The
 * rendezvous under attack by another uid (nobody): forged check-ins,
 * silent connections, a planted rendezvous directory, a stolen port, a
 * rank claimed twice; backup workers and restarts in a step; psd outliving
 * the workers; torchrun's variables in every worker; and psctl taking job and step from Slurm's environment,
 * against psd processes that require MUNGE (a private munged). The real
 * Slurm cluster: tests/slurm_test.sh. */
#define _GNU_SOURCE
#include <check.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "step.h"
#include "util.h"

Suite *suite_psrun_slurm(void);

/* ---- a fake Slurm step: real psrun tasks on localhost ----------------------------- */

/* A port nothing listens on now. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  ck_assert(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  close(fd);
  return ntohs(sa.sin_port);
}

/* A fake Slurm environment for task `rank` of a 2-task step of job `job`
 * on localhost; a slurm.conf naming a slurmctld that is not there (so
 * libslurm fails at once instead of retrying). */
typedef struct fake_env {
  char v[12][1200]; /* the entries */
  char *env[13];   /* NULL-terminated, for spawn */
} fake_env;

static void fake_slurm(fake_env *f, int rank, int job, int ntasks) {
  static char conf[1100], tmp[1200];
  snprintf(conf, sizeof conf, "%s/slurm.conf", tu_tmpdir());
  snprintf(tmp, sizeof tmp, "%s.%d", conf, (int)getpid());
  FILE *c = fopen(tmp, "w"); /* renamed into place: a task reading it never sees it empty */
  fprintf(c, "ClusterName=psrtest\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
             "NodeName=localhost\nPartitionName=p Nodes=localhost\nMessageTimeout=1\n");
  fclose(c);
  ck_assert(rename(tmp, conf) == 0);
  const char *fmt[] = {"SLURM_CONF=%s", "SLURM_PROCID=%d", "SLURM_LOCALID=%d", "SLURM_JOB_ID=%d",
                       "SLURM_NTASKS=%d", "SLURM_STEP_ID=0", "SLURMD_NODENAME=localhost",
                       "SLURM_STEP_NODELIST=localhost", "SLURM_STEP_NUM_NODES=1",
                       "SLURM_STEP_TASKS_PER_NODE=%d", "SLURM_DISTRIBUTION=block"};
  snprintf(f->v[0], sizeof f->v[0], fmt[0], conf);
  snprintf(f->v[1], sizeof f->v[1], fmt[1], rank);
  snprintf(f->v[2], sizeof f->v[2], fmt[2], rank);
  snprintf(f->v[3], sizeof f->v[3], fmt[3], job);
  for (int i = 4; i < 11; i++) snprintf(f->v[i], sizeof f->v[i], fmt[i], ntasks);
  for (int i = 0; i < 11; i++) f->env[i] = f->v[i];
  f->env[11] = NULL;
}

/* psrun as task `rank` of the fake step of ntasks, meeting on port in dir. */
static pid_t slurm_task_of(fake_env *f, int rank, int ntasks, int job, int port, const char *dir,
                           char *out, size_t outlen) {
  static char portbuf[16];
  snprintf(portbuf, sizeof portbuf, "%d", port);
  fake_slurm(f, rank, job, ntasks);
  char *argv[] = {(char *)tu_bin("psrun"), "--ps", "1", "--rendezvous-port", portbuf,
                  "--rendezvous-auth", "key", "--rendezvous", (char *)dir, "--connect-timeout",
                  "15", "--", (char *)tu_bin("tiny_worker"), "--steps", "20", NULL};
  return tu_spawn(argv, f->env, out, outlen);
}

static pid_t slurm_task(fake_env *f, int rank, int job, int port, const char *dir, char *out,
                        size_t outlen) {
  return slurm_task_of(f, rank, 2, job, port, dir, out, outlen);
}

/* The fake Slurm step of 4 tasks (ps0, w0-w2) running script with OPT K;
 * returns task 0's log and w1's, every task's status in st. */
static char *slurm_step_of(const char *opt, const char *k, const char *script, int st[4]) {
  static int seq;
  char dir[1100], out[4][1200], portbuf[16];
  snprintf(dir, sizeof dir, "%s/rdv-backup-%d", tu_tmpdir(), ++seq);
  mkdir(dir, 0700);
  snprintf(portbuf, sizeof portbuf, "%d", free_port());
  int job = 9000 + (int)(getpid() % 500) + seq;
  fake_env f[4];
  pid_t pid[4];
  for (int r = 0; r < 4; r++) {
    fake_slurm(&f[r], r, job, 4);
    snprintf(f[r].v[11], sizeof f[r].v[11], "TW=%s", tu_bin("tiny_worker"));
    f[r].env[11] = f[r].v[11];
    f[r].env[12] = NULL;
    char *argv[] = {(char *)tu_bin("psrun"), "--ps", "1", "--rendezvous-port", portbuf,
                    "--rendezvous-auth", "key", "--rendezvous", dir, "--connect-timeout", "15",
                    (char *)opt, (char *)k, "--", "/bin/sh", "-c", (char *)script, NULL};
    pid[r] = tu_spawn(argv, f[r].env, out[r], sizeof out[r]);
  }
  for (int r = 0; r < 4; r++) ck_assert_msg(tu_wait_pid(pid[r], 60, &st[r]) == 0, "task %d hung", r);
  char *log = tu_read_file(out[0]);
  char *w1 = tu_read_file(out[2]);
  size_t n = strlen(log) + strlen(w1) + 16;
  char *both = malloc(n);
  snprintf(both, n, "%s\n--- w1:\n%s", log, w1);
  free(log);
  free(w1);
  return both;
}

/* psrun as task 0 of a 2-task fake step of job 5353 whose task 1 never
 * comes, with OPT VAL; returns its log, its status in *st. */
static char *task0_alone(const char *opt, const char *val, int *st) {
  char dir[1100], out[1200], port[16];
  snprintf(dir, sizeof dir, "%s/rdv-alone", tu_tmpdir());
  mkdir(dir, 0700);
  snprintf(port, sizeof port, "%d", free_port());
  fake_env f;
  fake_slurm(&f, 0, 5353, 2);
  char *argv[] = {(char *)tu_bin("psrun"), "--ps", "1", "--rendezvous-port", port,
                  "--rendezvous-auth", "key", "--rendezvous", dir, "--connect-timeout", "1",
                  (char *)opt, (char *)val, "--", "true", NULL};
  pid_t pid = tu_spawn(argv, f.env, out, sizeof out);
  ck_assert_msg(tu_wait_pid(pid, 30, st) == 0, "psrun %s %s hung", opt, val);
  return tu_read_file(out);
}

/* --iface and --addr choose this task's address, or stop the task with a
 * sentence saying nothing matched; --connect-timeout bounds the check-ins
 * and names the tasks that never came. */
START_TEST(test_slurm_address_and_connect_timeout) {
  int st;
  char *log = task0_alone("--iface", "lo", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1 && strstr(log, "rendezvous on 127.0.0.1:") &&
                    strstr(log, "tasks 1 did not check in within 1 s"),
                "status %d: %s", st, log);
  free(log);
  log = task0_alone("--iface", "psrnone0", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1 &&
                    strstr(log, "no IPv4 address on this node matches --iface psrnone0"),
                "status %d: %s", st, log);
  free(log);
  /* Loopback's own address is 127.0.0.1; no interface holds this one. */
  log = task0_alone("--addr", "127.255.255.254/32", &st);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1 &&
                    strstr(log, "no IPv4 address on this node matches --addr 127.255.255.254/32"),
                "status %d: %s", st, log);
  free(log);
  log = task0_alone("--addr", "127.0.0.0/8", &st);
  ck_assert_msg(strstr(log, "rendezvous on 127.0.0.1:"), "%s", log);
  free(log);
}
END_TEST

/* ---- the rendezvous under attack (nobody) ------------------------------------------ */

/* bash as nobody (setpriv), its output to a file. */
static pid_t as_nobody(const char *script, char *out, size_t outlen) {
  char *argv[] = {"/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                  "/bin/bash", "-c", (char *)script, NULL};
  return tu_spawn(argv, NULL, out, outlen);
}

/* A nobody process opens two silent connections and forges a check-in
 * claiming rank 1 before the real rank 1 arrives: the forgery is refused,
 * the silent connections cost nothing, the real step completes. */
START_TEST(test_slurm_forged_and_silent_checkins) {
  char dir[1100], o0[1200], o1[1200], oa[1200], script[1200];
  snprintf(dir, sizeof dir, "%s/rdv-forge", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 5000 + (int)(getpid() % 1000);
  fake_env f0, f1;
  pid_t t0 = slurm_task(&f0, 0, job, port, dir, o0, sizeof o0);
  snprintf(script, sizeof script,
           "for i in $(seq 100); do exec 3<>/dev/tcp/127.0.0.1/%d && break; sleep 0.1; done; "
           "exec 4<>/dev/tcp/127.0.0.1/%d 5<>/dev/tcp/127.0.0.1/%d; read -t 5 l <&5; "
           "echo \"greeting: $l\"; echo \"HELLO PSRUN2 %d 0 65534 2 1 localhost 1 %064d %064d\" >&5;"
           " read -t 5 l <&5; echo \"reply: $l\"; sleep 14",
           port, port, port, job, 7, 9);
  pid_t att = as_nobody(script, oa, sizeof oa);
  ck_assert_msg(tu_wait_text(oa, "reply:", 15) == 0, "the forger got no answer");
  char *a = tu_read_file(oa);
  ck_assert_msg(strstr(a, "greeting: RDV PSRUN2 key") && strstr(a, "reply: REJECT"), "%s", a);
  ck_assert_msg(!strstr(a, "ROLE"), "the forger got a role: %s", a);
  free(a);
  double start = ps__now();
  pid_t t1 = slurm_task(&f1, 1, job, port, dir, o1, sizeof o1);
  int s0, s1;
  int w1 = tu_wait_pid(t1, 30, &s1), w0 = tu_wait_pid(t0, 30, &s0);
  double took = ps__now() - start;
  kill(att, SIGKILL);
  waitpid(att, NULL, 0);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  ck_assert_msg(w0 == 0 && w1 == 0, "the step did not finish:\n%s\n%s", l0, l1);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 0, "task 0: %s", l0);
  ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 0, "task 1: %s", l1);
  ck_assert_msg(strstr(l0, "refused a check-in from 127.0.0.1:") &&
                    strstr(l0, "claimed rank 1 (uid 65534), but its proof does not match"),
                "%s", l0);
  ck_assert_msg(strstr(l1, "{\"worker\":0,\"steps\":20") != NULL, "%s", l1);
  /* Two silent connections, each allowed 10 s, delayed nothing. */
  ck_assert_msg(took < tu_time_limit(8), "the step took %.1f s after rank 1 started", took);
  free(l0);
  free(l1);
}
END_TEST

/* A rendezvous directory planted by nobody is refused, by task 0 and by
 * a --role=worker step, with a sentence naming its owner. */
START_TEST(test_slurm_planted_directory) {
  char dir[1100], planted[1200], out[1200];
  snprintf(dir, sizeof dir, "%s/rdv-planted", tu_tmpdir());
  mkdir(dir, 01777);
  chmod(dir, 01777); /* like /tmp: others may create, the sticky bit protects ours */
  int job = 6000 + (int)(getpid() % 1000);
  snprintf(planted, sizeof planted, "%s/.psrun-%d.0", dir, job);
  ck_assert(mkdir(planted, 0755) == 0 && chown(planted, TU_NOBODY, TU_NOBODY) == 0);
  fake_env f;
  pid_t t0 = slurm_task(&f, 0, job, free_port(), dir, out, sizeof out);
  int st;
  ck_assert(tu_wait_pid(t0, 20, &st) == 0);
  char *log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", log);
  ck_assert_msg(strstr(log, "belongs to nobody (uid 65534), not to you"), "%s", log);
  free(log);
  char *argv[] = {(char *)tu_bin("psrun"), "--role=worker", "--rendezvous-auth", "key",
                  "--rendezvous", dir, "--connect-timeout", "3", "--", "true", NULL};
  pid_t w = tu_spawn(argv, f.env, out, sizeof out);
  ck_assert(tu_wait_pid(w, 20, &st) == 0);
  log = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "%s", log);
  ck_assert_msg(strstr(log, "belongs to nobody (uid 65534), not to you"), "%s", log);
  free(log);
}
END_TEST

/* A stranger (nobody) holding the rendezvous port and answering like task
 * 0: task 0 says so and stops; the member refuses the stranger. */
START_TEST(test_slurm_stolen_port) {
  char dir[1100], o0[1200], o1[1200], oa[1200], script[600];
  snprintf(dir, sizeof dir, "%s/rdv-stolen", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 7000 + (int)(getpid() % 1000);
  /* socat-free listener: python is not assumed; bash cannot listen, so
   * the stranger is a tiny nc-like loop in python only if present. */
  snprintf(script, sizeof script,
           "exec /usr/bin/python3 -c \"import socket,time\ns=socket.socket()\n"
           "s.bind(('127.0.0.1',%d)); s.listen(8); print('listening', flush=True)\n"
           "c,_=s.accept(); c.sendall(b'RDV PSRUN2 key\\n'); print(c.recv(4096), flush=True)\n"
           "c.sendall(b'ROLE worker 0 1 1 ' + b'ab'*32 + b'\\n'); time.sleep(20)\"",
           port);
  pid_t att = as_nobody(script, oa, sizeof oa);
  ck_assert_msg(tu_wait_text(oa, "listening", 10) == 0, "the stranger did not listen");
  fake_env f0, f1;
  pid_t t0 = slurm_task(&f0, 0, job, port, dir, o0, sizeof o0);
  pid_t t1 = slurm_task(&f1, 1, job, port, dir, o1, sizeof o1);
  int s0, s1;
  ck_assert(tu_wait_pid(t0, 30, &s0) == 0 && tu_wait_pid(t1, 30, &s1) == 0);
  kill(att, SIGKILL);
  waitpid(att, NULL, 0);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 1, "task 0: %s", l0);
  ck_assert_msg(strstr(l0, "Address already in use") && strstr(l0, "another process holds it"),
                "%s", l0);
  ck_assert_msg(WIFEXITED(s1) && WEXITSTATUS(s1) == 1, "task 1: %s", l1);
  ck_assert_msg(strstr(l1, "did not prove itself, so this task does not trust it"), "%s", l1);
  ck_assert_msg(!strstr(l1, "[w0]"), "a worker started: %s", l1);
  free(l0);
  free(l1);
}
END_TEST

/* Two tasks with valid proofs both claim rank 1 (a replay or a second
 * copy): task 0 stops the step, naming both peers. */
START_TEST(test_slurm_rank_claimed_twice) {
  char dir[1100], o0[1200], o1[1200], o2[1200];
  snprintf(dir, sizeof dir, "%s/rdv-twice", tu_tmpdir());
  mkdir(dir, 0700);
  int port = free_port(), job = 8000 + (int)(getpid() % 1000);
  fake_env f0, f1, f2;
  pid_t t0 = slurm_task_of(&f0, 0, 3, job, port, dir, o0, sizeof o0);
  pid_t a = slurm_task_of(&f1, 1, 3, job, port, dir, o1, sizeof o1);
  pid_t b = slurm_task_of(&f2, 1, 3, job, port, dir, o2, sizeof o2);
  int s0, sa, sb;
  ck_assert(tu_wait_pid(t0, 30, &s0) == 0);
  tu_wait_pid(a, 30, &sa);
  tu_wait_pid(b, 30, &sb);
  char *l0 = tu_read_file(o0);
  ck_assert_msg(WIFEXITED(s0) && WEXITSTATUS(s0) == 1, "%s", l0);
  ck_assert_msg(strstr(l0, "rank 1 was claimed twice, by 127.0.0.1:") &&
                    strstr(l0, ") and by 127.0.0.1:"),
                "%s", l0);
  free(l0);
}
END_TEST

/* The rendezvous' authentication is decided from slurm.conf: when
 * slurmctld cannot be asked (here none runs), "auto" stops the step with a
 * sentence naming the choices; it never falls back to another mode on its
 * own (a task that did would disagree with the others). */
START_TEST(test_slurm_auth_never_downgrades) {
  fake_env f;
  fake_slurm(&f, 0, 5151, 2);
  char out[1200];
  char *argv[] = {(char *)tu_bin("psrun"), "--ps", "1", "--rendezvous", (char *)tu_tmpdir(),
                  "--", (char *)tu_bin("tiny_worker"), "--steps", "2", NULL};
  pid_t pid = tu_spawn(argv, f.env, out, sizeof out);
  int st;
  ck_assert_msg(tu_wait_pid(pid, 60, &st) == 0, "psrun did not stop");
  char *text = tu_read_file(out);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) != 0, "psrun went on: %s", text);
  ck_assert_msg(text && strstr(text, "cannot tell whether this cluster uses MUNGE") &&
                    strstr(text, "--rendezvous-auth"),
                "no sentence naming the choice: %s", text);
  ck_assert_msg(!strstr(text, "parameter servers:"), "the step started anyway: %s", text);
  free(text);
}
END_TEST

/* The derived rendezvous port stays below Linux's default ephemeral range
 * (32768-60999) for any job and step, so an outgoing connection's port
 * never takes it first. */
START_TEST(test_derived_port_below_ephemeral) {
  unsigned seed = tu_seed("derived ports");
  srand(seed);
  psr_env e;
  memset(&e, 0, sizeof e);
  for (int i = 0; i < 100000; i++) {
    e.job_id = i < 1000 ? i : (long long)rand() * rand();
    e.step_id = i % 7 == 0 ? -1 : rand() % 100;
    int p = psr_derived_port(&e);
    ck_assert_msg(p >= 12000 && p < 32768, "job %lld step %lld: port %d", (long long)e.job_id,
                  (long long)e.step_id, p);
  }
}
END_TEST
/* ---- the step's workers ------------------------------------------------------------ */

/* Under Slurm too: task 0 spares a lost worker while the backups allow,
 * and the lost worker's task exits 0 so that srun's status is the job's. */
START_TEST(test_slurm_backup_worker_lost) {
  int st[4];
  char *log = slurm_step_of("--backup-workers", "1", TU_ABORT_W1, st);
  for (int r = 0; r < 4; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "task %d: status %d\n%s", r,
                  st[r], log);
  ck_assert_msg(strstr(log, "task 2 (w1) on localhost exited with status 134; going on without "
                            "it (1 of 1 backup worker(s) lost, 0 more may be lost)") &&
                    strstr(log, "the job goes on without this worker"),
                "%s", log);
  free(log);
  log = slurm_step_of("--backup-workers", "0", TU_ABORT_W1, st);
  ck_assert_msg(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 134, "status %d\n%s", st[0], log);
  ck_assert_msg(strstr(log, "task 2 (w1) on localhost exited with status 134; stopping every task"),
                "%s", log);
  free(log);
}
END_TEST

/* Under Slurm, --restart-workers restarts the dead worker in its own task
 * (counted per task there). */
START_TEST(test_slurm_restart_worker) {
  char script[1500];
  snprintf(script, sizeof script, "MARKER=%s/slurm-marker.%d; " TU_FAIL_W1_ONCE, tu_tmpdir(),
           (int)getpid());
  int st[4];
  char *log = slurm_step_of("--restart-workers", "1", script, st);
  for (int r = 0; r < 4; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "task %d: status %d\n%s", r,
                  st[r], log);
  ck_assert_msg(strstr(log, "w1 exited with status 1; restarted it (0 restart(s) left)") &&
                    strstr(log, "worker 1 rejoined") && strstr(log, "{\"worker\":1,\"steps\":200"),
                "%s", log);
  free(log);
}
END_TEST

/* Bug: under Slurm nothing named the workers a psd outliving them waits
 * for (psd exited 66 after its 60 s grace period). Workers 1 and 2 exit 0
 * without ps_client_finish (2 losses, 1 backup): 30 s after the last worker
 * task exited, task 0 asks the running psd and names them with their
 * state, and the step stops. */
START_TEST(test_slurm_psd_wait_names_workers) {
  int st[4];
  char *log = slurm_step_of("--backup-workers", "1", TU_TWO_SKIP_FINISH, st);
  ck_assert_msg(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 1, "status %d\n%s", st[0], log);
  ck_assert_msg(strstr(log, "psrun[0]: parameter servers did not exit within 30 s after the "
                            "workers finished: psd never saw w1 (lost), w2 (lost) call "
                            "ps_client_finish") &&
                    !strstr(log, "exited with status 66"),
                "%s", log);
  free(log);
}
END_TEST

/* torchrun's contract in a step (ps0 and w0-w2, all on localhost): task 0
 * learns MASTER_ADDR:MASTER_PORT from w0's task (MASTER) and hands it to
 * every worker with its LOCAL_RANK and LOCAL_WORLD_SIZE (WORLD), which
 * count the node's workers only: the ps before them is not a rank. */
START_TEST(test_slurm_torch_env) {
  char pre[1100], script[1500];
  snprintf(pre, sizeof pre, "%s/slurm-torchenv.%d", tu_tmpdir(), (int)getpid());
  snprintf(script, sizeof script,
           "{ echo; env; } >'%s.w'\"$PS_WORKER_INDEX\"; exec \"$TW\" --steps 5", pre);
  int st[4];
  char *log = slurm_step_of("--backup-workers", "0", script, st);
  for (int r = 0; r < 4; r++)
    ck_assert_msg(WIFEXITED(st[r]) && WEXITSTATUS(st[r]) == 0, "task %d: status %d\n%s", r,
                  st[r], log);
  char port0[64] = "", line[128];
  for (int w = 0; w < 3; w++) {
    char path[1200], v[256], want[16];
    snprintf(path, sizeof path, "%s.w%d", pre, w);
    char *dump = tu_read_file(path);
    ck_assert_msg(dump != NULL, "w%d wrote no environment:\n%s", w, log);
    const char *names[] = {"RANK", "LOCAL_RANK", "PS_LOCAL_RANK", "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE", "MASTER_ADDR"};
    snprintf(want, sizeof want, "%d", w);
    const char *wants[] = {want, want, want, "3", "3", "127.0.0.1"};
    for (int i = 0; i < 6; i++)
      ck_assert_msg(strcmp(tu_env_of(dump, names[i], v, sizeof v), wants[i]) == 0,
                    "w%d: %s='%s', not '%s'", w, names[i], v, wants[i]);
    tu_env_of(dump, "MASTER_PORT", v, sizeof v);
    if (w == 0) snprintf(port0, sizeof port0, "%.*s", (int)sizeof port0 - 1, v);
    ck_assert_msg(atoi(v) > 0 && atoi(v) < 65536 && strcmp(v, port0) == 0,
                  "w%d: MASTER_PORT='%s', w0's '%s'", w, v, port0);
    free(dump);
    unlink(path);
  }
  snprintf(line, sizeof line, "worker 0 (MASTER_ADDR:MASTER_PORT): 127.0.0.1:%s\n", port0);
  ck_assert_msg(strstr(log, line), "task 0 did not log '%s':\n%s", line, log);
  free(log);
}
END_TEST

/* ---- a flood of silent connections from another uid (psrun_flood) ---------------- */

enum {
  /* Steps started under the flood, every one of which must start (a
   * quarter of a second each; PS_FLOOD_TRIES=N runs N). */
  FLOOD_TRIES = 20,
  FLOOD_BURST = 1100, /* silent connections opened at once when the port answers */
  FLOOD_MAX = 3000,   /* ... and in all, each held open until the flooder is killed */
};
/* A try whose flooder never reached the port tested nothing: it fails.
 * (Such tries were once skipped: the flooder waited to be told that task 0
 * listened, and in the tries where the member raced it the whole step had
 * started, run and closed the port before the flooder's first connection,
 * which was then refused for 20 s. The flooder now knocks from before
 * task 0 starts, as an attacker watching squeue would.) */
#define FLOOD_MISSED "the flooder never reached the derived port"
/* The flood goes on this long after its burst (new connections as fast as
 * the flooder can open them, up to FLOOD_MAX), while the member checks in. */
#define FLOOD_S 0.5

/* A non-blocking connection to 127.0.0.1:port; fd or -1. */
static int flood_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

/* The flooder, a forked child that becomes nobody (uid and gid 65534)
 * and knocks on the port from before task 0 starts: once it answers, it
 * writes 'F' to report_fd, opens FLOOD_BURST silent connections, writes
 * 'B', goes on
 * opening more for FLOOD_S (FLOOD_MAX in all), writes its count, and
 * holds every one open, silent, until killed: task 0 keeps each for
 * PSR_CHECKIN_LINE_S unless it sheds it. */
static pid_t flooder(int port, int report_fd) {
  pid_t pid = fork();
  ck_assert(pid >= 0);
  if (pid) return pid;
  struct rlimit rl = {FLOOD_MAX + 64, FLOOD_MAX + 64};
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || setgroups(0, NULL) != 0 || setgid(TU_NOBODY) != 0 ||
      setuid(TU_NOBODY) != 0 || getuid() != TU_NOBODY)
    _exit(3);
  int first = -1, why = 0;
  for (double end = ps__now() + 20; first < 0 && ps__now() < end; usleep(500)) {
    struct pollfd p = {flood_connect(port), POLLOUT, 0};
    why = p.fd < 0 ? (errno == ECONNREFUSED ? 41 : 42) : 0;
    /* Up to 1.5 s: a SYN the kernel dropped is sent again after 1 s. */
    int n = p.fd >= 0 ? poll(&p, 1, 1500) : -1;
    if (n == 1 && !(p.revents & (POLLERR | POLLHUP))) first = p.fd;
    else if (p.fd >= 0) {
      why = n == 0 ? 43 : 44;
      close(p.fd);
    }
  }
  if (first < 0) _exit(why); /* 41 refused, 42 other error, 43 no answer, 44 error on poll */
  if (write(report_fd, "F", 1) != 1) _exit(4);
  int total = 1;
  while (total < FLOOD_BURST) total += flood_connect(port) >= 0;
  if (write(report_fd, "B", 1) != 1) _exit(5);
  for (double end = ps__now() + FLOOD_S; total < FLOOD_MAX && ps__now() < end;)
    total += flood_connect(port) >= 0;
  char msg[32];
  int len = snprintf(msg, sizeof msg, "%d\n", total);
  if (write(report_fd, msg, (size_t)len) != len) _exit(6);
  pause();
  _exit(0);
}

/* A job id whose derived rendezvous port nothing listens on. */
static int flood_job(int attempt) {
  psr_env e;
  memset(&e, 0, sizeof e);
  for (int job = 20000 + (int)(getpid() % 5000) * 8 + attempt * 97;; job++) {
    e.job_id = job;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)psr_derived_port(&e))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (ok) return job;
  }
}

/* psrun as task `rank` of a 2-task step of job on its derived port. */
static pid_t flood_task(fake_env *f, int rank, int job, const char *dir, char *out, size_t len) {
  fake_slurm(f, rank, job, 2);
  char *argv[] = {(char *)tu_bin("psrun"), "--ps", "1", "--rendezvous-auth", "key",
                  "--rendezvous", (char *)dir, "--connect-timeout", "15", "--",
                  (char *)tu_bin("tiny_worker"), "--steps", "5", NULL};
  return tu_spawn(argv, f->env, out, len);
}

/* A member whose connection is closed before task 0 greets it (as task 0
 * sheds one under a flood) checks in again: here the first listener on
 * the port closes it and goes away, then task 0 listens there. */
START_TEST(test_slurm_closed_checkin_tried_again) {
  char dir[1100], o0[1200], o1[1200];
  snprintf(dir, sizeof dir, "%s/rdv-again", tu_tmpdir());
  mkdir(dir, 0700);
  int job = flood_job(FLOOD_TRIES), one = 1; /* a port below the ephemeral range */
  int port = psr_derived_port(&(psr_env){.job_id = job});
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0); /* not in the tasks we spawn */
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  ck_assert(bind(lfd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(lfd, 4) == 0);
  fake_env f0, f1;
  pid_t t1 = flood_task(&f1, 1, job, dir, o1, sizeof o1);
  int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  ck_assert_msg(c >= 0, "task 1 never connected");
  close(c);
  close(lfd);
  pid_t t0 = flood_task(&f0, 0, job, dir, o0, sizeof o0);
  int s0, s1;
  int w1 = tu_wait_pid(t1, 30, &s1), w0 = tu_wait_pid(t0, 30, &s0);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  ck_assert_msg(w0 == 0 && w1 == 0 && WIFEXITED(s0) && WEXITSTATUS(s0) == 0 && WIFEXITED(s1) &&
                    WEXITSTATUS(s1) == 0,
                "the step did not finish:\n%s\n%s", l0, l1);
  ck_assert_msg(strstr(l1, "it closed our connection before greeting it") &&
                    strstr(l1, "checking in again (attempt 2,") &&
                    strstr(l1, "{\"worker\":0,\"steps\":5"),
                "%s", l1);
  free(l0);
  free(l1);
}
END_TEST

/* Lines of text holding needle. */
static int lines_with(const char *text, const char *needle) {
  int n = 0;
  for (const char *q = text; q && (q = strstr(q, needle)) != NULL; q += strlen(needle)) n++;
  return n;
}

/* One step started under the flood: "" or why it failed; the connections
 * the flooder opened, and whether the member had to check in again. */
static const char *flood_try(int attempt, int *flooded, int *again) {
  static char why[4096];
  char dir[1100], o0[1200], o1[1200];
  snprintf(dir, sizeof dir, "%s/rdv-flood", tu_tmpdir());
  mkdir(dir, 0700);
  int job = flood_job(attempt), pipefd[2];
  ck_assert(pipe2(pipefd, O_CLOEXEC) == 0);
  pid_t fl = flooder(psr_derived_port(&(psr_env){.job_id = job}), pipefd[1]);
  close(pipefd[1]);
  fake_env f0, f1;
  pid_t t0 = flood_task(&f0, 0, job, dir, o0, sizeof o0), t1 = 0;
  int listening = tu_wait_text(o0, "rendezvous on", 20) == 0;
  char first = 0, burst = 0, count[32] = "";
  struct pollfd p = {pipefd[0], POLLIN, 0};
  double waited = ps__now();
  if (poll(&p, 1, 20000) == 1 && read(pipefd[0], &first, 1) != 1) first = 0;
  /* Racing the burst, as in srun: the member starts as the flooder's first
   * connection is in, while its other FLOOD_BURST - 1 are being opened.
   * (Started with task 0, a member that finished checking in before a
   * flooder starved of the CPU knocked closed the port: a try that tested
   * nothing, as the CI's load once made one.) */
  if (attempt % 2 && first == 'F') t1 = flood_task(&f1, 1, job, dir, o1, sizeof o1);
  if (first == 'F' && poll(&p, 1, 20000) == 1 && read(pipefd[0], &burst, 1) != 1) burst = 0;
  waited = ps__now() - waited;
  char *early = burst == 'B' ? NULL : tu_read_file(o0);
  if (burst != 'B') {
    char cmd[200];
    snprintf(cmd, sizeof cmd, "ss -tan '( sport = :%d or dport = :%d )' | head -5 >&2; "
             "ss -s | head -3 >&2", psr_derived_port(&(psr_env){.job_id = job}),
             psr_derived_port(&(psr_env){.job_id = job}));
    if (system(cmd) != 0) fprintf(stderr, "(ss failed)\n");
  }
  if (!t1) t1 = flood_task(&f1, 1, job, dir, o1, sizeof o1); /* behind the burst, amid the flood */
  int s0 = -1, s1 = -1;
  int w1 = tu_wait_pid(t1, 40, &s1), w0 = tu_wait_pid(t0, 40, &s0);
  if (poll(&p, 1, 5000) == 1 && read(pipefd[0], count, sizeof count - 1) <= 0) count[0] = '\0';
  close(pipefd[0]);
  int fst = 0;
  kill(fl, SIGKILL);
  waitpid(fl, &fst, 0);
  *flooded = atoi(count);
  char *l0 = tu_read_file(o0), *l1 = tu_read_file(o1);
  *again = l1 && strstr(l1, "checking in again") != NULL;
  if (getenv("PS_TEST_VERBOSE"))
    fprintf(stderr, "--- try %d, task 0:\n%s--- task 1:\n%s", attempt, l0, l1);
  why[0] = '\0';
  if (!listening)
    snprintf(why, sizeof why, "task 0 did not listen within 20 s:\n%s", l0);
  else if (burst != 'B')
    snprintf(why, sizeof why, FLOOD_MISSED " %d (its status %d, "
             "tasks' %d and %d; waited %.1f s; task 0 then said: %.300s):\n%s",
             psr_derived_port(&(psr_env){.job_id = job}), WIFEXITED(fst) ? WEXITSTATUS(fst) : -1,
             s0, s1, waited, early ? early : "", l0);
  else if (w0 || w1 || !WIFEXITED(s0) || WEXITSTATUS(s0) || !WIFEXITED(s1) || WEXITSTATUS(s1) ||
           !strstr(l1, "{\"worker\":0,\"steps\":5"))
    snprintf(why, sizeof why, "the step did not start or finish (status %d, %d):\n--- task 0:\n"
             "%.1500s\n--- task 1:\n%.1500s", s0, s1, l0, l1);
  else if (attempt % 2 == 0 && !strstr(l0, "closed a silent connection from 127.0.0.1:"))
    snprintf(why, sizeof why, "the flood never filled task 0's pending set:\n%.2000s", l0);
  else if (lines_with(l0, "silent connection") > 4)
    snprintf(why, sizeof why, "%d lines about silent connections (rate limit: 1 per 5 s per "
             "kind, then a summary):\n%.2000s", lines_with(l0, "silent connection"), l0);
  free(early);
  free(l0);
  free(l1);
  return why;
}

/* Silent connections from nobody flood the derived rendezvous port as task
 * 0 starts listening (FLOOD_BURST at once, more for FLOOD_S), and the member
 * connects behind them (or, every other try, races them, as in srun): task 0 sheds the oldest silent ones, the member's
 * check-in is served (checking in again if its connection was shed), and
 * every step starts and finishes; task 0's lines about the flood stay few.
 * Was: the pending set full, task 0 closed every newer connection and the
 * member stopped ("did not greet with PSRUN2"). */
START_TEST(test_flood_of_silent_connections) {
  int started = 0, flooded = 0, again = 0, tries = FLOOD_TRIES;
  const char *env = getenv("PS_FLOOD_TRIES");
  if (env && atoi(env) > 0) tries = atoi(env);
  for (int i = 0; started < tries; i++) {
    int n = 0, a = 0;
    const char *why = flood_try(i, &n, &a);
    ck_assert_msg(!why[0], "try %d (%d started): %s", i + 1, started, why);
    ck_assert_msg(n >= FLOOD_BURST, "try %d: only %d connections flooded", i + 1, n);
    started++;
    flooded += n;
    again += a;
  }
  printf("psrun_flood: %d/%d steps started under floods of %d silent connections on the "
         "derived port (%d on average; the member checked in again in %d)\n",
         started, tries, flooded, flooded / tries, again);
}
END_TEST

/* ---- psctl under Slurm ------------------------------------------------------------- */

static const char *g_sock; /* the private munged's socket */

/* A psd as psrun starts one in a MUNGE step of job 4242 step 3 (the job's
 * secret too when secret is not NULL). */
static void munge_psd(tu_psd *ps, const char *secret) {
  char why[4096];
  g_sock = tu_munged_start(why, sizeof why);
  ck_assert_msg(g_sock, "%s", why);
  const char *args[] = {"--munge", "--munge-socket", g_sock, "--job-id", "4242", "--step-id",
                        "3", NULL};
  tu_psd_secret = secret;
  ck_assert_int_eq(tu_psd_start(ps, args), 0);
  tu_psd_secret = NULL;
}

/* psctl stats ADDR ARGS... (NULL-terminated) in an environment with
 * nothing of Slurm's or psrun's but the assignments (NULL-terminated); its
 * output in *text, its exit status returned. */
static int psctl_env(const tu_psd *ps, const char *const *assign, const char *const *args,
                     char **text) {
  char *argv[40] = {"/usr/bin/env"};
  int n = 1;
  const char *unset[] = {"SLURM_JOB_ID", "SLURM_STEP_ID", "PSD_SECRET", "PS_SECRET", "PS_MUNGE",
                         "PS_JOB_ID", "PS_STEP_ID", "PS_MUNGE_SOCKET"};
  for (size_t i = 0; i < sizeof unset / sizeof unset[0]; i++) {
    argv[n++] = "-u";
    argv[n++] = (char *)unset[i];
  }
  for (int i = 0; assign[i] && n < 26; i++) argv[n++] = (char *)assign[i];
  argv[n++] = (char *)tu_bin("psctl");
  argv[n++] = "stats";
  argv[n++] = (char *)ps->addr;
  for (int i = 0; args[i] && n < 38; i++) argv[n++] = (char *)args[i];
  argv[n] = NULL;
  char out[1200];
  int st;
  ck_assert(tu_wait_pid(tu_spawn(argv, NULL, out, sizeof out), 20, &st) == 0);
  *text = tu_read_file(out);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

#define JOB "SLURM_JOB_ID=4242"
#define STEP "SLURM_STEP_ID=3"
#define SECRET "s3cret-of-job-4242-0123456789abcdef"

/* Bug: psctl used Slurm's job and step only with --munge or --job. With
 * no secret under Slurm it presents MUNGE for the step in the environment
 * (a psd started by hand with --munge and no secret); where the step is
 * not in the environment (a batch script) it says --job is needed. */
START_TEST(test_psctl_munge_from_slurm_env) {
  tu_psd ps;
  munge_psd(&ps, NULL);
  char *text;
  const char *sock[] = {"--munge-socket", g_sock, NULL};
  const char *job_step[] = {JOB, STEP, NULL};
  int rc = psctl_env(&ps, job_step, sock, &text);
  ck_assert_msg(rc == 0 && strstr(text, "ps 0 of 1"), "rc %d: %s", rc, text);
  free(text);
  const char *none[] = {NULL};
  rc = psctl_env(&ps, none, sock, &text);
  ck_assert_msg(rc == 1 && strstr(text, "requires a MUNGE credential") &&
                    strstr(text, "psctl presented no secret (none in --secret-file, $PSD_SECRET "
                                 "or $PS_SECRET) and no MUNGE credential ($SLURM_JOB_ID is not "
                                 "set)"),
                "rc %d: %s", rc, text);
  free(text);
  const char *job_only[] = {JOB, NULL};
  rc = psctl_env(&ps, job_only, sock, &text);
  ck_assert_msg(rc == 2 && strstr(text, "$SLURM_STEP_ID is not set") &&
                    strstr(text, "pass --job JOB.STEP"),
                "rc %d: %s", rc, text);
  free(text);
  const char *with_job[] = {"--munge-socket", g_sock, "--job", "4242.3", NULL};
  rc = psctl_env(&ps, job_only, with_job, &text);
  ck_assert_msg(rc == 0 && strstr(text, "ps 0 of 1"), "rc %d: %s", rc, text);
  free(text);
  tu_psd_kill(&ps);
}
END_TEST

/* psrun's psd under Slurm wants the job's secret and MUNGE: a psrun
 * worker's environment (PS_SECRET, PS_MUNGE=1, PS_JOB_ID, PS_STEP_ID,
 * PS_MUNGE_SOCKET) is enough; a credential that falls short is refused
 * with what psctl presented. */
START_TEST(test_psctl_secret_and_munge_from_env) {
  tu_psd ps;
  munge_psd(&ps, SECRET);
  char sockvar[700], *text;
  snprintf(sockvar, sizeof sockvar, "PS_MUNGE_SOCKET=%s", g_sock);
  const char *worker[] = {"PS_SECRET=" SECRET, "PS_MUNGE=1", "PS_JOB_ID=4242", "PS_STEP_ID=3",
                          sockvar, NULL};
  const char *none[] = {NULL};
  int rc = psctl_env(&ps, worker, none, &text);
  ck_assert_msg(rc == 0 && strstr(text, "ps 0 of 1"), "rc %d: %s", rc, text);
  free(text);
  const char *sock[] = {"--munge-socket", g_sock, NULL};
  const char *job_step[] = {JOB, STEP, NULL};
  rc = psctl_env(&ps, job_step, sock, &text);
  ck_assert_msg(rc == 1 && strstr(text, "authentication failed") &&
                    strstr(text, "psctl presented no secret (none in --secret-file, $PSD_SECRET "
                                 "or $PS_SECRET) and a MUNGE credential for job 4242 step 3 "
                                 "(from $SLURM_JOB_ID and $SLURM_STEP_ID)"),
                "rc %d: %s", rc, text);
  free(text);
  const char *secret_only[] = {JOB, STEP, "PS_SECRET=" SECRET, NULL};
  rc = psctl_env(&ps, secret_only, sock, &text);
  ck_assert_msg(rc == 1 && strstr(text, "requires a MUNGE credential") &&
                    strstr(text, "psctl presented the secret from $PS_SECRET and no MUNGE "
                                 "credential (with a secret, psctl takes --munge or --job "
                                 "JOB.STEP to present one)"),
                "rc %d: %s", rc, text);
  free(text);
  const char *other_step[] = {"PS_SECRET=" SECRET, "PS_MUNGE=1", "PS_JOB_ID=4242",
                              "PS_STEP_ID=4", sockvar, NULL};
  rc = psctl_env(&ps, other_step, none, &text);
  ck_assert_msg(rc == 1 && strstr(text, "psctl presented the secret from $PS_SECRET and a "
                                        "MUNGE credential for job 4242 step 4 (from $PS_JOB_ID "
                                        "and $PS_STEP_ID)"),
                "rc %d: %s", rc, text);
  free(text);
  tu_psd_kill(&ps);
}
END_TEST

static void psctl_teardown(void) { tu_munged_stop(); }

Suite *suite_psrun_slurm(void) {
  Suite *s = suite_create("psrun_slurm");
  TCase *tc = tcase_create("psrun_slurm");
  tcase_set_timeout(tc, 120);
  if (tu_can_be_another_user()) {
    tcase_add_test(tc, test_slurm_forged_and_silent_checkins);
    tcase_add_test(tc, test_slurm_planted_directory);
    tcase_add_test(tc, test_slurm_rank_claimed_twice);
    /* The stranger's listener is a python3 one-liner (bash cannot listen). */
    if (access("/usr/bin/python3", X_OK) == 0) tcase_add_test(tc, test_slurm_stolen_port);
    else tu_skip_tests("psrun_slurm", "test_slurm_stolen_port", "/usr/bin/python3 is missing");
  } else {
    tu_skip_tests("psrun_slurm",
                  "test_slurm_forged_and_silent_checkins, test_slurm_planted_directory, "
                  "test_slurm_rank_claimed_twice, test_slurm_stolen_port",
                  "acting as another user (nobody) needs root and setpriv");
  }
  tcase_add_test(tc, test_slurm_auth_never_downgrades);
  tcase_add_test(tc, test_slurm_address_and_connect_timeout);
  tcase_add_test(tc, test_slurm_closed_checkin_tried_again);
  tcase_add_test(tc, test_derived_port_below_ephemeral);
  tcase_add_test(tc, test_slurm_backup_worker_lost);
  tcase_add_test(tc, test_slurm_restart_worker);
  tcase_add_test(tc, test_slurm_psd_wait_names_workers);
  tcase_add_test(tc, test_slurm_torch_env);
  suite_add_tcase(s, tc);
  if (system("command -v munged >/dev/null 2>&1") != 0) {
    tu_skip_tests("psrun_slurm", "the psctl MUNGE cases",
                  "munged is not installed: apt-get install munge");
    return s;
  }
  tc = tcase_create("psctl");
  tcase_set_timeout(tc, 60);
  tcase_add_checked_fixture(tc, NULL, psctl_teardown);
  tcase_add_test(tc, test_psctl_munge_from_slurm_env);
  tcase_add_test(tc, test_psctl_secret_and_munge_from_env);
  suite_add_tcase(s, tc);
  return s;
}

/* The flood needs another uid: root, to become nobody (as the
 * checkpoint_users suites). Skipped as a whole otherwise. */
Suite *suite_psrun_flood(void) {
  if (getuid() != 0) {
    printf("SKIP: psrun_flood: flooding as another user (nobody) needs root\n");
    return NULL;
  }
  Suite *s = suite_create("psrun_flood");
  TCase *tc = tcase_create("flood");
  tcase_set_timeout(tc, 240);
  tcase_add_test(tc, test_flood_of_silent_connections);
  suite_add_tcase(s, tc);
  return s;
}
