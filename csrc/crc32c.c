/* crc32c.c: CRC-32C (Castagnoli), the checksum of every checkpoint section,
 * the 64-bit content hash of blobs, and the digest under state fingerprints
 * (below).
 *
 *     def flor_crc32c(crc, data):
 *         crc ^= 0xFFFFFFFF
 *         for b in data:
 *             crc = TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
 *         return crc ^ 0xFFFFFFFF
 *
 * On x86-64 with SSE4.2 and on AArch64 with the CRC extension the hardware
 * instruction does 8 bytes at a time; elsewhere the table above is used.
 * Touches no Python object: safe without the GIL and in a forked child.
 */
#include "flor.h"

#include <string.h>

/* Reflected polynomial 0x82F63B78; TABLE[i] is the CRC of the byte i. */
static const uint32_t crc_table[256] = {
    0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu, 0x26a1e7e8u,
    0xd4ca64ebu, 0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu, 0x4d43cfd0u, 0xbf284cd3u,
    0xac78bf27u, 0x5e133c24u, 0x105ec76fu, 0xe235446cu, 0xf165b798u, 0x030e349bu, 0xd7c45070u,
    0x25afd373u, 0x36ff2087u, 0xc494a384u, 0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u,
    0x5d1d08bfu, 0xaf768bbcu, 0xbc267848u, 0x4e4dfb4bu, 0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u,
    0x33ed7d2au, 0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u, 0xaa64d611u, 0x580f5512u,
    0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau, 0x30e349b1u,
    0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu, 0x1642ae59u, 0xe4292d5au,
    0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au, 0x7da08661u, 0x8fcb0562u, 0x9c9bf696u,
    0x6ef07595u, 0x417b1dbcu, 0xb3109ebfu, 0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u,
    0x67dafa54u, 0x95b17957u, 0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu,
    0xfe53516fu, 0xed03a29bu, 0x1f682198u, 0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u,
    0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u, 0xdbfc821cu, 0x2997011fu, 0x3ac7f2ebu,
    0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u, 0x61c69362u, 0x93ad1061u,
    0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu, 0x4767748au, 0xb50cf789u, 0xeb1fcbadu,
    0x197448aeu, 0x0a24bb5au, 0xf84f3859u, 0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u,
    0x7198540du, 0x83f3d70eu, 0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u,
    0xa55230e6u, 0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu,
    0xdde0eb2au, 0x2f8b6829u, 0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu, 0x456cac67u,
    0xb7072f64u, 0xa457dc90u, 0x563c5f93u, 0x082f63b7u, 0xfa44e0b4u, 0xe9141340u, 0x1b7f9043u,
    0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu, 0x92a8fc17u, 0x60c37f14u, 0x73938ce0u,
    0x81f80fe3u, 0x55326b08u, 0xa759e80bu, 0xb4091bffu, 0x466298fcu, 0x1871a4d8u, 0xea1a27dbu,
    0xf94ad42fu, 0x0b21572cu, 0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u, 0xa24bb5a6u,
    0x502036a5u, 0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
    0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u, 0x0e330a81u,
    0xfc588982u, 0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du, 0x758fe5d6u, 0x87e466d5u,
    0x94b49521u, 0x66df1622u, 0x38cc2a06u, 0xcaa7a905u, 0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u,
    0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu, 0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u,
    0x0417b1dbu, 0xf67c32d8u, 0xe52cc12cu, 0x1747422fu, 0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu,
    0x5a048dffu, 0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u, 0xd3d3e1abu, 0x21b862a8u,
    0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u, 0x590ab964u,
    0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u, 0x7fab5e8cu, 0x8dc0dd8fu,
    0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu, 0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u,
    0x37faccf1u, 0x69e9f0d5u, 0x9b8273d6u, 0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u,
    0x4f48173du, 0xbd23943eu, 0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au,
    0xc69f7b69u, 0xd5cf889du, 0x27a40b9eu, 0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu,
    0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u,
};

static uint32_t
crc_soft(uint32_t crc, const unsigned char *p, size_t len)
{
    while (len--) {
        crc = crc_table[(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
    }
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define FLOR_HAVE_HW_CRC 1

__attribute__((target("sse4.2"))) static uint32_t
crc_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c = crc;
    while (len && ((uintptr_t)p & 7u)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        len -= 8;
    }
    while (len--) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
    }
    return (uint32_t)c;
}

static int
have_hw(void)
{
    return __builtin_cpu_supports("sse4.2");
}

#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define FLOR_HAVE_HW_CRC 1

static uint32_t
crc_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        crc = __crc32cd(crc, v);
        p += 8;
        len -= 8;
    }
    while (len--) {
        crc = __crc32cb(crc, *p++);
    }
    return crc;
}

static int
have_hw(void)
{
    return 1;
}
#endif

uint32_t
flor_crc32c(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    crc = ~crc;
#ifdef FLOR_HAVE_HW_CRC
    if (have_hw()) {
        return ~crc_hw(crc, p, len);
    }
#endif
    return ~crc_soft(crc, p, len);
}

/* ------------------------------------------------------------------ */
/* Content hash: a 64-bit digest of a blob's bytes, by which a checkpoint  */
/* finds the same bytes in an earlier one.                                */
/*                                                                       */
/*     def flor_hash64(data):                # in FLOR_HASH_CHUNK pieces, */
/*         h = len(data)                     # each continuing from the   */
/*         for piece in chunks(data):        # last, so that a copy loop  */
/*             h = mix(h, piece)             # can hash each piece while  */
/*         return h                          # it is still in cache       */
/*                                                                       */
/* mix() runs four independent multiply-rotate lanes over 32-byte words  */
/* (the construction of xxHash64), folds them with the length, and ends  */
/* with an avalanche.  Not cryptographic: it tells apart the states of   */
/* one run, and a match is confirmed by size and dtype.                  */

#define H1 0x9E3779B185EBCA87ull
#define H2 0xC2B2AE3D27D4EB4Full
#define H3 0x165667B19E3779F9ull
#define H4 0x85EBCA77C2B2AE63ull
#define H5 0x27D4EB2F165667C5ull

static inline uint64_t
rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
rd64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t
lane(uint64_t acc, uint64_t in)
{
    acc += in * H2;
    acc = rotl64(acc, 31);
    return acc * H1;
}

static inline uint64_t
fold(uint64_t h, uint64_t v)
{
    h ^= lane(0, v);
    return h * H1 + H4;
}

static uint64_t
mix(uint64_t seed, const unsigned char *p, size_t len)
{
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + H1 + H2, v2 = seed + H2, v3 = seed, v4 = seed - H1;
        do {
            v1 = lane(v1, rd64(p));
            v2 = lane(v2, rd64(p + 8));
            v3 = lane(v3, rd64(p + 16));
            v4 = lane(v4, rd64(p + 24));
            p += 32;
        } while (end - p >= 32);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = fold(fold(fold(fold(h, v1), v2), v3), v4);
    }
    else {
        h = seed + H5;
    }
    h += (uint64_t)len;
    while (end - p >= 8) {
        h ^= lane(0, rd64(p));
        h = rotl64(h, 27) * H1 + H4;
        p += 8;
    }
    while (p < end) {
        h ^= (*p++) * H5;
        h = rotl64(h, 11) * H1;
    }
    h ^= h >> 33;
    h *= H2;
    h ^= h >> 29;
    h *= H3;
    h ^= h >> 32;
    return h;
}

uint64_t
flor_hash64_start(uint64_t nbytes)
{
    return nbytes ^ H3;
}

uint64_t
flor_hash64_update(uint64_t h, const void *piece, size_t len)
{
    return mix(h, piece, len);
}

uint64_t
flor_hash64(const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint64_t h = flor_hash64_start(len);
    size_t done = 0;
    while (done < len) {
        size_t n = len - done < FLOR_HASH_CHUNK ? len - done : FLOR_HASH_CHUNK;
        h = mix(h, p + done, n);
        done += n;
    }
    return h;
}

/* ------------------------------------------------------------------ */
/* State digest: the 64-bit sum under state fingerprints (version 2).     */
/*                                                                       */
/*     def flor_digest64(total, first, data):  # data: whole 8-byte words  */
/*         for i, w in enumerate(int64 words of data, start=first):       */
/*             x = w ^ ((i + 1) * K1)          # (a last partial word is  */
/*             x = x * K2                      # zero-padded)             */
/*             x = x ^ (x >> 31)               # arithmetic shift         */
/*             total += x                      # all modulo 2**64         */
/*         return total                                                   */
/*                                                                       */
/* A sum of independent terms: any split of the words into pieces, in any */
/* order, gives the same total, so a GPU computes it with tensor kernels  */
/* (flor/_cuda.py, the same arithmetic on int64 tensors) where the bytes  */
/* live, and a state fingerprints alike on either device.                 */

#define D1 0x9E3779B97F4A7C15ull
#define D2 0xBF58476D1CE4E5B9ull

static inline uint64_t
digest_term(uint64_t w, uint64_t i)
{
    uint64_t x = (w ^ ((i + 1) * D1)) * D2;
    /* x >> 31 as an arithmetic shift of a signed 64-bit number (torch's). */
    uint64_t sra = (x >> 31) | ((uint64_t)0 - (x >> 63)) << 33;
    return x ^ sra;
}

uint64_t
flor_digest64(uint64_t total, uint64_t first, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint64_t i = first;
    while (len >= 8) {
        total += digest_term(rd64(p), i++);
        p += 8;
        len -= 8;
    }
    if (len > 0) {
        uint64_t w = 0;
        memcpy(&w, p, len);
        total += digest_term(w, i);
    }
    return total;
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, crc=0, /)\n--\n\n"
             "CRC-32C of a bytes-like object, continuing from crc.");

static PyObject *
mod_crc32c(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    unsigned long crc = 0;
    uint32_t r;
    if (flor_check_nargs("crc32c", nargs, 1, 2) < 0) {
        return NULL;
    }
    if (nargs == 2) {
        crc = PyLong_AsUnsignedLong(args[1]);
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = flor_crc32c((uint32_t)crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

PyDoc_STRVAR(hash64_doc,
             "hash64(data, /)\n--\n\n"
             "The 64-bit content hash by which checkpoints find unchanged blobs.");

static PyObject *
mod_hash64(PyObject *Py_UNUSED(module), PyObject *data)
{
    Py_buffer view;
    uint64_t r;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = flor_hash64(view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(r);
}

PyDoc_STRVAR(digest64_doc,
             "digest64(data, first=0, /)\n--\n\n"
             "The sum under version 2 state fingerprints of data's 8-byte words, the\n"
             "first of them the word at index first of the state (a last partial word\n"
             "is zero-padded).");

static PyObject *
mod_digest64(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    unsigned long long first = 0;
    uint64_t r;
    if (flor_check_nargs("digest64", nargs, 1, 2) < 0) {
        return NULL;
    }
    if (nargs == 2) {
        first = PyLong_AsUnsignedLongLong(args[1]);
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = flor_digest64(0, (uint64_t)first, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(r);
}

PyMethodDef flor_crc32c_functions[] = {
    {"crc32c", FLOR_CFUNC(mod_crc32c), METH_FASTCALL, crc32c_doc},
    {"hash64", FLOR_CFUNC(mod_hash64), METH_O, hash64_doc},
    {"digest64", FLOR_CFUNC(mod_digest64), METH_FASTCALL, digest64_doc},
    {NULL, NULL, 0, NULL},
};
