/* Whether this machine runs Intel AMX instructions (scripts/setup.sh). llama.cpp, compiled for the
 * machine it is built on, uses AMX wherever the CPU lists it; some virtual machines list AMX and then
 * fault on its first instruction (SIGILL), which would stop every llama-server at its first request.
 * Exit 0: AMX runs here; anything else (a fault, a refused permission): build without it. */
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 1;
    unsigned char config[64];
    memset(config, 0, sizeof config);
    config[0] = 1;   /* palette 1 */
    config[16] = 64; /* tile 0: 64 bytes a row */
    config[48] = 16; /* tile 0: 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
