/* picklescan.c: the pickle of a checkpoint's metadata, scanned before
 * anything unpickles it, so that the unpickler only ever sees opcodes flor
 * writes and a memo proportional to the metadata's size.
 *
 *     def scan_pickle(meta):
 *         memo = 0
 *         for op, arg in opcodes(meta):   # each complete: its argument inside meta
 *             if op is unknown, text, a persistent id, an extension code or an
 *                 out-of-band buffer: bad()   # flor writes binary opcodes only
 *             if op == MEMOIZE: memo += 1
 *             if op in (BINPUT, LONG_BINPUT):
 *                 if arg > memo: bad()    # memo indices grow one at a time
 *                 if arg == memo: memo += 1
 *             if op in (BINGET, LONG_BINGET) and arg >= memo: bad()
 *             if op == STOP: return ok if nothing follows it else bad()
 *         bad()                           # an incomplete pickle
 *
 * bad() raises FormatError(path, "metadata", why).
 */
#include "flor.h"
#include "format.h"

int
flor_scan_pickle(flor_state *st, const char *path, const unsigned char *p, uint64_t len)
{
    const unsigned char *end = p + len;
    uint64_t memo = 0, arg;
    const char *why = NULL;

    while (p < end) {
        unsigned char op = *p++;
        uint64_t avail = (uint64_t)(end - p), skip = 0, idx = UINT64_MAX;
        /* Kept as written: the case labels are grouped by the size of their opcode's
         * argument. */
        /* clang-format off */
        switch (op) {
        case '(': case '.': case '0': case '1': case '2': case 'N': case 'R': case 'a':
        case 'b': case 'd': case '}': case 'e': case 'l': case ']': case 'o': case 's':
        case 't': case ')': case 'u': case 0x81: case 0x85: case 0x86: case 0x87:
        case 0x88: case 0x89: case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93:
            break;
        case 0x94: /* MEMOIZE */
            memo++;
            break;
        case 'K': case 0x80:
            skip = 1;
            break;
        case 'M':
            skip = 2;
            break;
        case 'J':
            skip = 4;
            break;
        case 'G': case 0x95:
            skip = 8;
            break;
        case 'q': case 'h': /* BINPUT, BINGET */
            if (avail < 1) {
                goto truncated;
            }
            idx = p[0];
            skip = 1;
            break;
        case 'r': case 'j': /* LONG_BINPUT, LONG_BINGET */
            if (avail < 4) {
                goto truncated;
            }
            idx = get32(p);
            skip = 4;
            break;
        case 0x8a: case 'U': case 'C': case 0x8c: /* 1-byte length */
            if (avail < 1) {
                goto truncated;
            }
            skip = 1 + (uint64_t)p[0];
            break;
        case 0x8b: case 'T': case 'X': case 'B': /* 4-byte length */
            if (avail < 4) {
                goto truncated;
            }
            skip = 4 + (uint64_t)get32(p);
            break;
        case 0x8d: case 0x8e: case 0x96: /* 8-byte length */
            if (avail < 8) {
                goto truncated;
            }
            arg = get64(p);
            if (arg > avail - 8) {
                goto truncated;
            }
            skip = 8 + arg;
            break;
        default:
            why = "an opcode that flor never writes (text, persistent id, extension or "
                  "out-of-band buffer)";
            goto bad;
        }
        /* clang-format on */
        if (skip > avail) {
            goto truncated;
        }
        if (idx != UINT64_MAX) {
            if (op == 'q' || op == 'r') {
                if (idx > memo) {
                    why = "a memo index beyond the objects so far";
                    goto bad;
                }
                if (idx == memo) {
                    memo++;
                }
            }
            else if (idx >= memo) {
                why = "a reference to a memo entry never stored";
                goto bad;
            }
        }
        if (op == '.') {
            if (p != end) {
                why = "bytes after its end";
                goto bad;
            }
            return 0;
        }
        p += skip;
    }
truncated:
    why = "an incomplete pickle";
bad:
    flor_format_error(st, path, "metadata", "the pickle holds %s", why);
    return -1;
}
