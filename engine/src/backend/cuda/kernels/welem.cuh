// One element of a row for the formats that define one element of a block (`kelem(block, i)`,
// BLOCK_LEN, BLOCK_BYTES): the tiled products and the embedding read weights this way.
__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    return kelem(row + (c / BLOCK_LEN) * BLOCK_BYTES, c % BLOCK_LEN);
}
