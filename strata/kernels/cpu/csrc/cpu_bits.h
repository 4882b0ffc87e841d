// Bit casts between a float and its IEEE-754 bits, for the library's compiled units (std::bit_cast is C++20).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

}  // namespace
