/* The GGUF header reader's one hot loop: stepping over an array of `count` strings (a u64 length, then the bytes)
 * from byte `pos` of a buffer of `size` bytes. A 49k-token vocabulary and its merges are ~100k strings, which a
 * Python loop walks in tens of milliseconds. *end gets the byte after the last string, or -1 where the array runs
 * past the buffer. */
#include <stdint.h>
#include <string.h>

void gguf_skip_strings(const uint8_t *buf, int64_t size, int64_t pos, int64_t count, int64_t *end) {
    for (int64_t i = 0; i < count; i++) {
        uint64_t n;
        if (pos < 0 || pos + 8 > size) { *end = -1; return; }
        memcpy(&n, buf + pos, 8); /* little-endian, as GGUF and x86-64 are */
        if (n > (uint64_t)(size - pos - 8)) { *end = -1; return; }
        pos += 8 + (int64_t)n;
    }
    *end = pos;
}
