import { defineConfig } from 'vitest/config'

// Every test file starts its own `casfs serve` (FUSE mounts, one store each): one file
// at a time keeps them from competing for the machine's two cores.
export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    fileParallelism: false,
    testTimeout: 120_000,
    hookTimeout: 120_000,
  },
})
