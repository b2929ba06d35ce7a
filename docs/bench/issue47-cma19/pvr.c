// Issue 47, helper C (nineteenth): the cost of process_vm_readv against memcpy, 2 processes.
// Build: gcc -O2 -o pvr pvr.c; run: ./pvr TOTAL_KIB CHUNK_KIB [THP 0/1].
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <signal.h>
static double cpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){
  size_t total=(size_t)atoi(argv[1])<<10, chunk=(size_t)atoi(argv[2])<<10; int huge=argc>3&&atoi(argv[3]);
  char*sh=mmap(0,total,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0); memset(sh,1,total);
  char*pb=aligned_alloc(2<<20,total); if(huge) madvise(pb,total,MADV_HUGEPAGE); memset(pb,1,total);
  int pfd[2]; pipe(pfd);
  pid_t c=fork(); if(c==0){ char x; read(pfd[0],&x,1); _exit(0);} // child keeps pb (COW: child owns same VA)
  // the child's pb is a COW copy: touch in child? reading is fine: pages shared COW, still real pages.
  char*dst=aligned_alloc(4096,chunk); memset(dst,0,chunk);
  int it=200; double t0,t1;
  for(int w=0;w<2;w++){ t0=cpu(); for(int i=0;i<it;i++) for(size_t o=0;o<total;o+=chunk){ memcpy(dst,sh+o,chunk); __asm__ volatile(""::"r"(dst):"memory");} t1=cpu(); }
  printf("memcpy from shm: %.1f us per %zu KiB (chunk %zu KiB)\n",(t1-t0)/it,total>>10,chunk>>10);
  for(int w=0;w<2;w++){ t0=cpu(); for(int i=0;i<it;i++) for(size_t o=0;o<total;o+=chunk){ struct iovec l={dst,chunk},r={pb+o,chunk}; if(process_vm_readv(c,&l,1,&r,1,0)!=(ssize_t)chunk){perror("pvr");return 1;}} t1=cpu(); }
  printf("process_vm_readv:  %.1f us per %zu KiB (chunk %zu KiB)%s\n",(t1-t0)/it,total>>10,chunk>>10,huge?" THP":"");
  write(pfd[1],"x",1); wait(0); return 0; }
