/* pmi2check.c - smoke test of Slurm's PMI-2 across nodes (used by deploy/slurm/smoke.sh).
 *
 * Every rank puts "k<rank>" = "v<rank*7>", fences, reads its right neighbour's key and prints
 * "pmi2 ok rank=R size=S host=H".  Build: cc -o pmi2check pmi2check.c -lpmi2
 * Run:   srun -N2 -n4 --mpi=pmi2 ./pmi2check
 */
#include <slurm/pmi2.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void)
{
    int spawned = 0, size = 0, rank = 0, appnum = 0, len = 0, rc;
    char jobid[256], key[64], val[PMI2_MAX_VALLEN], want[64], host[256];

    rc = PMI2_Init(&spawned, &size, &rank, &appnum);
    if (rc != PMI2_SUCCESS) {
        fprintf(stderr, "PMI2_Init failed: %d\n", rc);
        return 1;
    }
    rc = PMI2_Job_GetId(jobid, sizeof jobid);
    if (rc != PMI2_SUCCESS) {
        fprintf(stderr, "rank %d: PMI2_Job_GetId failed: %d\n", rank, rc);
        return 1;
    }
    snprintf(key, sizeof key, "k%d", rank);
    snprintf(val, sizeof val, "v%d", rank * 7);
    if ((rc = PMI2_KVS_Put(key, val)) != PMI2_SUCCESS || (rc = PMI2_KVS_Fence()) != PMI2_SUCCESS) {
        fprintf(stderr, "rank %d: put/fence failed: %d\n", rank, rc);
        return 1;
    }
    int peer = (rank + 1) % size;
    snprintf(key, sizeof key, "k%d", peer);
    snprintf(want, sizeof want, "v%d", peer * 7);
    rc = PMI2_KVS_Get(jobid, PMI2_ID_NULL, key, val, sizeof val, &len);
    if (rc != PMI2_SUCCESS || strcmp(val, want) != 0) {
        fprintf(stderr, "rank %d: get %s: rc=%d got '%s' want '%s'\n", rank, key, rc, val, want);
        return 1;
    }
    if (gethostname(host, sizeof host) != 0)
        strcpy(host, "?");
    printf("pmi2 ok rank=%d size=%d host=%s\n", rank, size, host);
    fflush(stdout);
    PMI2_Finalize();
    return 0;
}
