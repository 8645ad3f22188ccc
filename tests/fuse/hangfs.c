/*
 * hangfs: a FUSE file system whose statfs never answers, which is exactly what a Lustre or
 * NFS mount with unreachable servers looks like to statfs(2): the caller sleeps in the kernel
 * (state D) and no signal ends it. Killing this server aborts the connection and frees it.
 * Built and run by tests/storage/storage_fuse.rs:  hangfs MOUNTPOINT -f -o fsname=fabricgate-hang,subtype=hangfs
 */
#define FUSE_USE_VERSION 31
#include <fuse.h>
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static int hang_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
	(void)fi;
	memset(st, 0, sizeof(*st));
	if (strcmp(path, "/") != 0)
		return -ENOENT;
	st->st_mode = S_IFDIR | 0755;
	st->st_nlink = 2;
	return 0;
}

static int hang_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t off,
			struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	(void)off;
	(void)fi;
	(void)flags;
	if (strcmp(path, "/") != 0)
		return -ENOENT;
	filler(buf, ".", NULL, 0, 0);
	filler(buf, "..", NULL, 0, 0);
	return 0;
}

static int hang_statfs(const char *path, struct statvfs *st)
{
	(void)path;
	(void)st;
	for (;;)
		pause(); /* never reply */
	return 0;
}

static const struct fuse_operations ops = {
	.getattr = hang_getattr,
	.readdir = hang_readdir,
	.statfs = hang_statfs,
};

int main(int argc, char *argv[])
{
	/* If the test process dies without cleaning up, take the mount's server down with it. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	return fuse_main(argc, argv, &ops, NULL);
}
