#!/usr/bin/perl
# Reads one of etcd's .proto files (from Debian's golang-etcd-server-dev) and writes it without
# what only etcd's Go build needs: the gogoproto options and the HTTP-gateway annotations
# (google.api.http). Messages, fields and services are left exactly as they are, so the code
# protoc generates from the result speaks etcd's v3 API on the wire.
#   strip.pl IN.proto OUT.proto
use strict;
use warnings;
my ($in, $out) = @ARGV;
die "usage: strip.pl IN.proto OUT.proto\n" unless defined $out;
open(my $fh, '<', $in) or die "strip.pl: $in: $!\n";
local $/;
my $text = <$fh>;
close $fh;
$text =~ s/^import "gogoproto\/gogo\.proto";\n//mg;
$text =~ s/^import "google\/api\/annotations\.proto";\n//mg;
$text =~ s/^option \(gogoproto\.[^;]*;\n//mg;
# option (google.api.http) = { post: "/v3/kv/range" body: "*" additional_bindings { ... } };
$text =~ s/^\s*option \(google\.api\.http\) = (?<b>\{(?:[^{}]++|(?&b))*\});\n//mg;
die "strip.pl: $in still names gogoproto or google.api\n" if $text =~ /gogoproto|google\.api/;
open(my $o, '>', $out) or die "strip.pl: $out: $!\n";
print $o $text;
close $o;
