/* SNAKE_HIDDEN: a C function internal to an extension module, not exported from its .so
   (only its PyInit_ function is), so a function of the same name in another library can
   never interpose on ours, or the other way round. */
#ifndef SNAKE_HIDDEN_H
#define SNAKE_HIDDEN_H

#if defined(__GNUC__)
#define SNAKE_HIDDEN __attribute__((visibility("hidden")))
#else
#define SNAKE_HIDDEN
#endif

#endif
